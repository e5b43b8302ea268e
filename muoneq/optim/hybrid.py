"""Common machinery of the orthogonalized-update optimizers (MuonEq, Muon and the baselines).

One optimizer object serves a whole model. Each param group is either

* a *matrix* group (``use_muon=True``): EMA momentum (Algorithm 1, lines 5–10), a
  subclass-specific map from the momentum to an update direction (for MuonEq: DiagPre then
  ``NS_K``), decoupled weight decay and the shape-dependent learning-rate factor ``a``::

      M ← βM + (1−β)G;   M̃ = βM + (1−β)G (Nesterov) or M
      X ← (1 − η·λ)·X − a·η·direction(M̃)

* or an AdamW group (``use_muon=False``), updated by :func:`muoneq.optim.adamw.adamw_update`.

Subclasses override :meth:`_direction` (and :meth:`_init_matrix_state` when the method keeps
extra state), plus ``_extra_defaults``/``_validate_extra`` for their own hyper-parameters.
Parameters with more than two dimensions (conv filters) are viewed as ``(out, in·kh·kw)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from numbers import Real

import torch
from torch import Tensor

from muoneq.newton_schulz import normalize_coefficients, resolve_dtype
from muoneq.optim.adamw import adamw_update, init_adamw_state

LR_ADJUST = ("rms", "spectral", "spectral_unclamped", "none")


def lr_scale(shape: tuple[int, int], lr_adjust: str) -> float:
    """The factor ``a`` multiplying the learning rate of an m×n matrix update.

    ``"rms"``: ``0.2·√max(m, n)`` (Moonlight's, the paper's ``a``: the update's RMS matches
    AdamW's); ``"spectral"``: ``√max(1, m/n)`` (Keller Jordan's); ``"spectral_unclamped"``:
    ``√(m/n)`` = √(fan_out/fan_in) (Bernstein's, Muon+'s); ``"none"``: 1.
    """
    m, n = shape
    if lr_adjust == "rms":
        return 0.2 * math.sqrt(max(m, n))
    if lr_adjust == "spectral":
        return math.sqrt(max(1.0, m / n))
    if lr_adjust == "spectral_unclamped":
        return math.sqrt(m / n)
    if lr_adjust == "none":
        return 1.0
    raise ValueError(f"lr_adjust: unknown value {lr_adjust!r}; allowed: {', '.join(LR_ADJUST)}")


def matrix_shape(p: Tensor) -> tuple[int, int]:
    """``(out, in·kh·kw)``: the 2-D view under which a ≥2-D parameter is orthogonalized."""
    return (p.shape[0], math.prod(p.shape[1:]))


def _number(group: dict, key: str, *, low: float = 0.0, high: float | None = None,
            high_open: bool = False) -> None:
    value = group[key]
    if isinstance(value, Tensor):
        value = value.item()
    if not isinstance(value, Real) or isinstance(value, bool) or math.isnan(value):
        raise ValueError(f"{key}: expected a number, got {group[key]!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = "" if high is None else f" and {'<' if high_open else '≤'} {high}"
        raise ValueError(f"{key}: must be ≥ {low}{bound}, got {value!r}")


class HybridOrthogonalOptimizer(torch.optim.Optimizer):
    """Base class: orthogonalized updates for matrix groups, AdamW for the rest."""

    #: Hyper-parameters a subclass adds on top of the common ones (name → default).
    _extra_defaults: dict = {}

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        *,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_coefficients="quintic",
        ns_dtype=torch.bfloat16,
        lr_adjust: str = "rms",
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        use_muon: bool = True,
        **extra,
    ):
        unknown = set(extra) - set(self._extra_defaults)
        if unknown:
            allowed = sorted(
                ["lr", "momentum", "nesterov", "weight_decay", "ns_steps", "ns_coefficients",
                 "ns_dtype", "lr_adjust", "adamw_betas", "adamw_eps", "use_muon",
                 *self._extra_defaults]
            )
            raise TypeError(
                f"{type(self).__name__}: unknown hyper-parameter(s) {sorted(unknown)}; "
                f"allowed: {', '.join(allowed)}"
            )
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_coefficients=ns_coefficients, ns_dtype=ns_dtype,
            lr_adjust=lr_adjust, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
            use_muon=use_muon,
        )
        defaults.update({**self._extra_defaults, **extra})
        super().__init__(params, defaults)

    # ----------------------------------------------------------------- validation
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._validate(group)
        except ValueError:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            if group["use_muon"]:
                self._init_matrix_state(p, self.state[p], group)
            else:
                init_adamw_state(p, self.state[p])

    def _validate(self, group: dict) -> None:
        _number(group, "lr")
        _number(group, "weight_decay")
        _number(group, "adamw_eps")
        if not isinstance(group["use_muon"], bool):
            raise ValueError(f"use_muon: expected True or False, got {group['use_muon']!r}")
        betas = group["adamw_betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"adamw_betas: expected two numbers in [0, 1), got {betas!r}")
        group["adamw_betas"] = tuple(betas)
        for i, b in enumerate(betas):
            _number({f"adamw_betas[{i}]": b}, f"adamw_betas[{i}]", high=1.0, high_open=True)
        if not group["use_muon"]:
            return
        _number(group, "momentum", high=1.0, high_open=True)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"nesterov: expected True or False, got {group['nesterov']!r}")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"ns_steps: expected an integer ≥ 0, got {steps!r}")
        group["ns_coefficients"] = normalize_coefficients(group["ns_coefficients"], steps)
        group["ns_dtype"] = resolve_dtype(group["ns_dtype"])
        if group["lr_adjust"] not in LR_ADJUST:
            raise ValueError(
                f"lr_adjust: unknown value {group['lr_adjust']!r}; allowed: {', '.join(LR_ADJUST)}"
            )
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"{type(self).__name__}: a parameter of shape {tuple(p.shape)} is in a "
                    "matrix (use_muon=True) group; 0-D and 1-D tensors must go to a "
                    "use_muon=False (AdamW) group — muoneq.param_groups(model) routes them"
                )
        self._validate_extra(group)

    def _validate_extra(self, group: dict) -> None:
        """Check a subclass's own hyper-parameters (raise ``ValueError`` naming the key)."""

    # ----------------------------------------------------------------- state
    def _init_matrix_state(self, p: Tensor, state: dict, group: dict) -> None:
        """Persistent state of a matrix parameter: one momentum buffer (as Muon)."""
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ----------------------------------------------------------------- the update
    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        """Map the (Nesterov-mixed) momentum, viewed as a matrix, to the update direction."""
        raise NotImplementedError

    def _directions(self, params: list[Tensor], m_tildes: list[Tensor], group: dict) -> list[Tensor]:
        """Directions for every parameter of a group (overridden for batched/distributed paths)."""
        return [
            self._direction(p, m.reshape(matrix_shape(p)), self.state[p], group)
            for p, m in zip(params, m_tildes, strict=True)
        ]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Perform one optimization step; ``closure`` is evaluated with gradients enabled."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            if any(g.is_sparse for g in grads):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if group["use_muon"]:
                self._matrix_step(params, grads, group)
            else:
                beta1, beta2 = group["adamw_betas"]
                states = [self.state[p] for p in params]
                adamw_update(
                    params, grads,
                    [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                    [s["step"] for s in states],
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["adamw_eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss

    def _matrix_step(self, params: list[Tensor], grads: list[Tensor], group: dict) -> None:
        beta, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        bufs = [self.state[p]["momentum_buffer"] for p in params]
        torch._foreach_lerp_(bufs, grads, 1 - beta)  # M ← βM + (1−β)G
        m_tildes = torch._foreach_lerp(grads, bufs, beta) if group["nesterov"] else bufs
        directions = self._directions(params, m_tildes, group)
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        for p, d in zip(params, directions, strict=True):
            p.add_(d.reshape(p.shape), alpha=-lr * lr_scale(matrix_shape(p), group["lr_adjust"]))
