"""Stored layouts (transposed, expert banks, fused blocks): a parameter gets exactly the update
its matrices would get as separate ``nn.Linear`` weights, in every single-process path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muoneq import MuonEq
from muoneq.layout import MatrixLayout
from muoneq.optim import AdaMuon, Mousse, MuonPlus, NorMuon
from tests.helpers.layout import CASES, run_separate, run_stored

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("batching", ["per_matrix", "stacked"])
@pytest.mark.parametrize("mode, lr_adjust, ns_dtype", [
    ("R", "rms", "bfloat16"), ("RC", "spectral", "float32"), ("none", "rms", "float32"),
    ("C", "spectral_unclamped", "bfloat16")])
def test_muoneq_updates_each_block_exactly_as_a_separate_linear(case, batching, mode,
                                                                lr_adjust, ns_dtype):
    def make(groups):
        return MuonEq(groups, lr=0.02, weight_decay=0.1, mode=mode, lr_adjust=lr_adjust,
                      ns_dtype=ns_dtype, batching=batching)

    assert torch.equal(run_stored(case, make), run_separate(case, make))


ONE_BLOCK = [c for c in CASES if len(c.blocks) == 1]


@pytest.mark.parametrize("case", ONE_BLOCK, ids=[c.id for c in ONE_BLOCK])
@pytest.mark.parametrize("method", [NorMuon, AdaMuon, Mousse, MuonPlus])
def test_methods_with_state_see_the_transposed_matrix(case, method):
    def make(groups):
        return method(groups, lr=0.02, ns_dtype="float32")

    assert torch.equal(run_stored(case, make), run_separate(case, make))


def test_methods_with_state_refuse_several_blocks():
    p = nn.Parameter(torch.randn(12, 4))
    with pytest.raises(ValueError, match=r"^splits/batch_dims: NorMuon keeps state per matrix"):
        NorMuon([{"params": [p], "splits": [4, 4, 4]}])


@pytest.mark.parametrize(("keys", "message"), [
    ({"splits": [4, 4]}, r"^splits: \[4, 4\] must add up to the 12 outputs"),
    ({"splits": [6, 0, 6]}, r"^splits: expected null or a list of positive row counts"),
    ({"splits": 3}, r"^splits: expected null or a list"),
    ({"transposed": "yes"}, r"^transposed: expected True or False"),
    ({"batch_dims": 1}, r"^batch_dims: a parameter of shape \(12, 4\) with batch_dims=1"),
    ({"batch_dims": -1}, r"^batch_dims: expected an integer ≥ 0"),
])
def test_layout_keys_are_checked_with_one_line_errors(keys, message):
    p = nn.Parameter(torch.randn(12, 4))
    with pytest.raises(ValueError, match=message):
        MuonEq([{"params": [p], **keys}])


def test_transposed_splits_are_along_the_outputs_and_scale_per_block():
    """A transposed (in=3, out=6) weight split (2, 4): the blocks are columns of the stored
    tensor, and each block's shape factor reads its own (rows, in)."""
    layout = MatrixLayout((3, 6), transposed=True, splits=(2, 4))
    assert layout.matrix == (6, 3) and layout.blocks == [(2, 3), (4, 3)]
    stored = torch.arange(18.0).reshape(3, 6)
    first, second = layout.matrices(stored)
    assert torch.equal(first, stored[:, :2].T) and torch.equal(second, stored[:, 2:].T)
    assert first.is_contiguous() and second.is_contiguous()
    out = torch.empty(3, 6)
    layout.put(out, 0, first)
    layout.put(out, 1, second)
    assert torch.equal(out, stored)
    # a row shard (stored rows 1:3) holds every block's part of those inputs
    pieces = list(layout.pieces(stored[1:3], start=1))
    assert [(shape, tuple(v.shape)) for shape, v in pieces] == [((2, 3), (2, 2)),
                                                                ((4, 3), (4, 2))]
    assert layout.describe() == "(2, 3) + (4, 3)"


def test_plain_row_shards_cut_blocks_where_they_fall():
    layout = MatrixLayout((6, 2), splits=(4, 2))
    stored = torch.arange(12.0).reshape(6, 2)
    pieces = list(layout.pieces(stored[3:6], start=3))
    assert [shape for shape, _ in pieces] == [(4, 2), (2, 2)]
    assert torch.equal(pieces[0][1], stored[3:4]) and torch.equal(pieces[1][1], stored[4:6])


def test_state_dicts_from_before_layouts_load_with_the_plain_layout():
    p = nn.Parameter(torch.randn(4, 3))
    opt = MuonEq([p], lr=0.02)
    saved = opt.state_dict()
    for key in ("transposed", "splits", "batch_dims"):
        del saved["param_groups"][0][key]
    opt.load_state_dict(saved)
    group = opt.param_groups[0]
    assert (group["transposed"], group["splits"], group["batch_dims"]) == (False, None, 0)



@pytest.mark.parametrize("batching", ["per_matrix", "stacked"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("keys, dtype", [({"transposed": True}, torch.float64),
                                         ({}, torch.bfloat16)], ids=["transposed", "bf16"])
def test_a_staged_bank_steps_only_the_matrices_that_have_a_gradient(batching, nesterov, keys,
                                                                    dtype):
    """Banks staged outside the stacks (stored transposed, or below float32 with Nesterov):
    a matrix whose gradient is None is left as it is (torch.optim skips it) and the others step
    as an optimizer of their own (before: a TypeError with Nesterov; without it the matrix
    moved by the directions left in the bank from its last step)."""
    torch.manual_seed(0)
    start = [torch.randn(16, 8, dtype=dtype) for _ in range(3)]
    grads = [[torch.randn(16, 8, dtype=dtype) for _ in range(3)] for _ in range(2)]

    def run(kept: list[int]) -> list[dict[int, torch.Tensor]]:
        """The kept matrices after each of two steps; matrix 1 has no gradient at the second."""
        params = [nn.Parameter(start[i].clone()) for i in kept]
        opt = MuonEq([{"params": params, **keys}], lr=0.02, nesterov=nesterov,
                     batching=batching, ns_dtype=torch.float32)
        after = []
        for step in range(2):
            for p, i in zip(params, kept, strict=True):
                p.grad = None if (step, i) == (1, 1) else grads[step][i].clone()
            opt.step()
            after.append({i: p.detach().clone() for p, i in zip(params, kept, strict=True)})
        return after

    together = run([0, 1, 2])
    assert torch.equal(together[1][1], together[0][1])
    assert not torch.equal(together[1][0], together[0][0])
    if dtype == torch.float64:  # the others: as if matrix 1 were in no bank with them
        apart = run([0, 2])
        for i in (0, 2):
            torch.testing.assert_close(together[1][i], apart[1][i], rtol=0, atol=1e-12)
