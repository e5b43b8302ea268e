"""``capturable=True``: a step that reads no number back from a tensor (what a CUDA graph needs),
with ``lr`` and ``weight_decay`` as tensors read on the device. CUDA graphs themselves cannot
be captured here; these checks run on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muoneq import MuonEq, build_optimizer
from tests.helpers.dispatch import dispatched

pytestmark = pytest.mark.usefixtures("one_thread")

#: What reading a tensor's value on the host dispatches (``.item()``, ``float(t)``, ``bool(t)``).
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item"}
SHAPES = [(12, 8), (12, 8), (8, 20), (6, 3, 2, 2)]


def model_params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    matrices = [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    vectors = [nn.Parameter(torch.randn(8, generator=gen)) for _ in range(2)]
    return matrices, vectors


def with_grads(params, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def optimizer(matrices, vectors, lr, weight_decay, **options):
    return MuonEq([{"params": matrices}, {"params": vectors, "use_muon": False}], lr=lr,
                  weight_decay=weight_decay, batching="stacked", **options)


@pytest.mark.parametrize("mode", ["R", "RC", "none"])
def test_a_capturable_step_reads_no_number_from_a_tensor(mode):
    matrices, vectors = model_params()
    lr, weight_decay = torch.tensor(0.02), torch.tensor(0.1)
    opt = optimizer(matrices, vectors, lr, weight_decay, mode=mode, capturable=True)
    for seed in range(2):
        with_grads(matrices + vectors, seed)
        opt.step()
    with_grads(matrices + vectors, 2)
    assert not HOST_READS & set(dispatched(opt.step).ops)
    # the same step with capturable=False reads the tensor lr (once per group)
    plain = optimizer(matrices, vectors, lr, weight_decay, mode=mode)
    assert HOST_READS & set(dispatched(plain.step).ops)


def test_changing_the_lr_tensor_in_place_changes_the_step():
    """An LR scheduler writes a tensor ``lr`` in place (``fill_``): the next step uses it, as a
    non-capturable optimizer given the numbers does, on the matrices and on AdamW's groups."""
    steps = [(0.02, 0.1), (0.005, 0.1), (0.005, 0.0)]
    twins = [model_params(), model_params()]
    lr, weight_decay = torch.tensor(steps[0][0]), torch.tensor(steps[0][1])
    capturable = optimizer(*twins[0], lr, weight_decay, capturable=True)
    plain = optimizer(*twins[1], *steps[0])
    for seed, (step_lr, step_decay) in enumerate(steps):
        lr.fill_(step_lr)
        weight_decay.fill_(step_decay)
        for group in plain.param_groups:
            group["lr"], group["weight_decay"] = step_lr, step_decay
        for matrices, vectors in twins:
            with_grads(matrices + vectors, seed)
        capturable.step()
        plain.step()
    for a, b in zip(twins[0][0] + twins[0][1], twins[1][0] + twins[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert capturable.state[twins[0][1][0]]["step"].device == twins[0][1][0].device


def test_a_new_lr_is_read_without_planning_again():
    matrices, _ = model_params()
    lr = torch.tensor(0.02)
    opt = MuonEq(matrices, lr=lr, weight_decay=torch.tensor(0.1), batching="stacked",
                 capturable=True)
    with_grads(matrices, 0)
    opt.step()
    lr.fill_(0.01)
    before = [p.detach().clone() for p in matrices]
    assert dispatched(opt.step).allocated == []
    assert all(not torch.equal(a, b) for a, b in zip(before, matrices, strict=True))


def test_the_per_matrix_step_is_capturable_too():
    """One matrix per chunk (the CPU default) runs the same functions: no host read, and the
    plain step's weights."""
    twins = [model_params(), model_params()]
    lr, weight_decay = torch.tensor(0.02), torch.tensor(0.1)
    capturable = MuonEq(twins[0][0], lr=lr, weight_decay=weight_decay, batching="per_matrix",
                        capturable=True)
    plain = MuonEq(twins[1][0], lr=0.02, weight_decay=0.1, batching="per_matrix")
    for seed in range(3):
        for matrices, _ in twins:
            with_grads(matrices, seed)
        assert not HOST_READS & set(dispatched(capturable.step).ops)
        plain.step()
    for a, b in zip(twins[0][0], twins[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_capturable_refuses_compile():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="^capturable: compile=True's graphs are not captured"):
        MuonEq([p], capturable=True, batching="stacked", compile=True)


def test_a_matrix_without_a_gradient_plans_the_step_again():
    """The matrices with a gradient are planned again (a new plan allocates its buffers, so do
    not capture such a step); the others keep their weights and momentum."""
    twins = [model_params(), model_params()]
    opts = [MuonEq(twins[0][0], lr=torch.tensor(0.02), batching="stacked", capturable=True),
            MuonEq(twins[1][0], lr=0.02, batching="stacked")]
    for (matrices, _), opt in zip(twins, opts, strict=True):
        with_grads(matrices, 0)
        opt.step()
        matrices[0].grad = None
        before = matrices[0].detach().clone()
        with_grads(matrices[1:], 1)
        opt.step()
        assert torch.equal(matrices[0], before)
    for a, b in zip(twins[0][0], twins[1][0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_methods_that_step_matrices_one_at_a_time_refuse_capturable():
    with pytest.raises(TypeError, match="capturable"):
        build_optimizer("normuon", [nn.Parameter(torch.randn(4, 4))], capturable=True)
