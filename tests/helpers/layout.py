"""Stored layouts and the separate matrices they hold, written out by hand for the tests.

Each case is a parameter as some layer stores it (transposed, an expert bank, a fused
projection) and the plain 2-D matrices a user would get by writing the same weights as
separate ``nn.Linear`` layers. ``stored(blocks)`` builds the stored tensor from the blocks with
plain torch operations (independently of :mod:`muoneq.layout`), so a test can compare an
optimizer step on the stored parameter with steps on the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class LayoutCase:
    id: str
    blocks: list[tuple[int, int]]  # (out, in) of each separate matrix, in layout order
    stored: callable  # list of block tensors -> the stored tensor
    keys: dict = field(default_factory=dict)  # the param-group keys of the stored layout


def _conv_transpose(blocks):
    (w,) = blocks  # (out, in·3·3) → stored (in, out, 3, 3) as nn.ConvTranspose2d
    out, n = w.shape
    return w.reshape(out, n // 9, 3, 3).transpose(0, 1).contiguous()


CASES = [
    LayoutCase("plain", [(6, 5)], lambda b: b[0].clone()),
    LayoutCase("conv1d", [(7, 5)], lambda b: b[0].T.contiguous(), {"transposed": True}),
    LayoutCase("conv_transpose", [(4, 18)], _conv_transpose, {"transposed": True}),
    LayoutCase("qkv", [(4, 6)] * 3, lambda b: torch.cat(b), {"splits": (4, 4, 4)}),
    LayoutCase("gqa_qkv", [(8, 6), (2, 6), (2, 6)], lambda b: torch.cat(b),
               {"splits": (8, 2, 2)}),
    LayoutCase("conv1d_qkv", [(5, 6)] * 3, lambda b: torch.cat(b).T.contiguous(),
               {"transposed": True, "splits": (5, 5, 5)}),
    LayoutCase("experts", [(5, 6)] * 3, lambda b: torch.stack(b), {"batch_dims": 1}),
    LayoutCase("experts_transposed", [(7, 6)] * 2,
               lambda b: torch.stack([x.T for x in b]).contiguous(),
               {"batch_dims": 1, "transposed": True}),
    LayoutCase("experts_gate_up", [(3, 6), (3, 6)] * 2,
               lambda b: torch.stack([torch.cat(b[:2]), torch.cat(b[2:])]),
               {"batch_dims": 1, "splits": (3, 3)}),
]


def block_grads(case: LayoutCase, step: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(100 * step + 7)
    return [torch.randn(shape, generator=gen) for shape in case.blocks]


def initial_blocks(case: LayoutCase) -> list[Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=gen) / shape[1] ** 0.5 for shape in case.blocks]


#: optimizer steps a layout test compares
STEPS = 3


def run_stored(case, make, steps=STEPS, device="cpu"):
    """Steps on the stored parameter, with the case's layout keys."""
    p = nn.Parameter(case.stored(initial_blocks(case)).to(device))
    opt = make([{"params": [p], **case.keys}])
    for t in range(steps):
        p.grad = case.stored(block_grads(case, t)).to(device)
        opt.step()
    return p.detach().cpu()


def run_separate(case, make, steps=STEPS, device="cpu"):
    """The same steps on the blocks as separate plain matrices; returns them stored."""
    blocks = [nn.Parameter(b.to(device)) for b in initial_blocks(case)]
    opt = make([{"params": blocks}])
    for t in range(steps):
        for b, g in zip(blocks, block_grads(case, t), strict=True):
            b.grad = g.to(device)
        opt.step()
    return case.stored([b.detach().cpu() for b in blocks])
