"""MARS-AdamW (Yuan et al., 2024): AdamW on a variance-reduced gradient."""

from __future__ import annotations

from typing import Never

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.optim.adamw import adamw_update, init_adamw_state
from muoneq.optim.base import Hyper, OptimizerBase, refuse_unknown
from muoneq.optim.checks import betas, boolean, nonnegative


class MarsAdamW(OptimizerBase):
    r"""MARS-AdamW: "MARS: Unleashing the Power of Variance Reduction for Training Large
    Models" (Yuan, Liu, Wu, Zhou, Gu, 2024, arXiv:2411.10438; official code AGI-Arena/MARS),
    the ``mars_type="mars-adamw"``, ``is_approx=True`` variant.

    For a parameter ``X`` with gradient ``g_t`` (previous gradient ``g_{t−1}``; ``g_0 = 0``)::

        c_t = g_t + γ·β₁/(1−β₁)·(g_t − g_{t−1})
        c_t ← c_t / ‖c_t‖₂   if ‖c_t‖₂ > 1                    (per tensor)
        m ← β₁m + (1−β₁)c_t,     v ← β₂v + (1−β₂)c_t²
        X ← (1 − η·λ)X − η·(m/(1−β₁ᵗ)) / (√(v/(1−β₂ᵗ)) + ε)

    i.e. AdamW (decoupled weight decay, bias correction, step for step equal to
    ``torch.optim.AdamW`` when ``γ = 0`` and no gradient norm exceeds 1) applied to ``c_t``.

    Choices, following the official implementation:

    * First step: ``g_0 = 0``, so ``c_1 = (1 + γβ₁/(1−β₁))·g_1`` (then clipped).
    * 1-D (and 0-D) tensors take plain AdamW on ``g_t`` unless ``optimize_1d=True`` (the
      official default ``optimize_1d=False``). Unlike the official code they use the group's
      ``lr``, ``betas``, ``eps`` and ``weight_decay`` (the paper's setting: one set of
      hyper-parameters; put them in their own param group to change them), and unlike the
      copy in the MuonEq repository their weight decay is kept.
    * Tensors with ≥ 2 dimensions take the MARS correction. (The official code tests for
      exactly 2 dimensions, which sends conv filters to plain AdamW; we treat them as the
      matrices they are.)

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (as ``torch.optim.AdamW``) and
    ``last_grad`` (``g_{t−1}``), created up front.

    Args:
        params: parameters or param groups.
        lr: learning rate ``η``.
        betas: ``(β₁, β₂)``, each in [0, 1); the paper's MARS-AdamW runs use (0.9, 0.95).
        eps: ``ε`` ≥ 0.
        weight_decay: decoupled weight decay ``λ`` ≥ 0 (every tensor, 1-D included).
        gamma: variance-reduction coefficient ``γ`` ≥ 0 (0.025 in the paper; 0 gives AdamW up
            to the clipping).
        optimize_1d: apply the MARS correction to 0-D/1-D tensors too.
    """

    hyperparameters = {
        "lr": Hyper(nonnegative),
        "betas": Hyper(betas),
        "eps": Hyper(nonnegative),
        "weight_decay": Hyper(nonnegative),
        "gamma": Hyper(nonnegative),
        "optimize_1d": Hyper(boolean),
    }

    def __init__(self, params: ParamsT, *, lr: float | Tensor = 3e-3,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, gamma: float = 0.025, optimize_1d: bool = False,
                 **misspelled: Never):
        refuse_unknown(type(self), misspelled)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      gamma=gamma, optimize_1d=optimize_1d))

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        for p in group["params"]:
            if p.is_complex():
                raise ValueError(
                    f"MarsAdamW: a complex parameter of shape {tuple(p.shape)}; the "
                    "correction's clipping is defined per real tensor: pass "
                    "torch.view_as_real(p) instead"
                )

    def _init_state(self, p: Tensor, group: dict) -> None:
        state = self.state[p]
        init_adamw_state(p, state)
        state["last_grad"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` is evaluated with gradients enabled."""
        loss = self._evaluate(closure)
        for group, params in self._groups_to_step():
            beta1, beta2 = group["betas"]
            scale = group["gamma"] * beta1 / (1 - beta1)
            inputs = []
            for p in params:
                grad, state = p.grad, self.state[p]
                if p.ndim >= 2 or group["optimize_1d"]:
                    corrected = grad + scale * (grad - state["last_grad"])
                    corrected.div_(corrected.norm().clamp(min=1.0))  # c / max(‖c‖₂, 1)
                    state["last_grad"].copy_(grad)
                    inputs.append(corrected)
                else:
                    inputs.append(grad)
            adamw_update(
                params, inputs, [self.state[p] for p in params],
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
        return loss
