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

Directions are computed one matrix at a time on CPU, as stacks of same-shape matrices on
accelerators, split between ranks under DDP and gathered into whole matrices under FSDP2
(:mod:`muoneq.optim.distributed`); every path gives the single-process result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from muoneq.newton_schulz import (
    Workspace,
    dtype_name,
    normalize_coefficients,
    ns_flops,
    resolve_dtype,
)
from muoneq.optim.adamw import adamw_update, init_adamw_state
from muoneq.optim.contract import (
    check_betas,
    check_flag,
    check_group_keys,
    check_number,
    evaluate_closure,
    params_with_grads,
    scalar,
    tensor_steps,
)
from muoneq.optim.distributed import (
    MatrixSlot,
    check_same_gradients,
    exchange_replicated,
    exchange_row_sharded,
    full_tensor,
    is_dtensor,
    local,
    local_part,
    row_shard_dim,
)

LR_ADJUST = ("rms", "spectral", "spectral_unclamped", "none")
BATCHING = ("auto", "per_matrix", "stacked")
#: Largest stack (elements) of same-shape matrices orthogonalized in one batched call.
_STACK_ELEMENTS = 1 << 26


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


class HybridOrthogonalOptimizer(torch.optim.Optimizer):
    """Base class: orthogonalized updates for matrix groups, AdamW for the rest.

    Optimizer-wide settings of how (not what) is computed:

    * ``distributed``: ``"auto"`` (default) splits the matrices of a step between the ranks of
      ``process_group`` (default: the world) when ``torch.distributed`` is initialized with more
      than one rank and the parameters are replicated (DDP); ``False`` makes every rank compute
      every matrix; ``True`` is ``"auto"`` that raises if no process group is initialized.
      Row-sharded ``DTensor`` parameters (FSDP2) always gather whole matrices, whatever the
      setting. Only methods whose :attr:`stateless_direction` is true can be split.
    * ``batching``: ``"per_matrix"`` (one matrix at a time), ``"stacked"`` (same-shape matrices
      in one batched call, stateless directions only) or ``"auto"`` (default): stacked on
      accelerators, per matrix on CPU.
    """

    #: Hyper-parameters a subclass adds on top of the common ones (name → default).
    _extra_defaults: dict = {}

    #: Group keys introduced after state dicts were first written (name → the value that
    #: reproduces the older behaviour): a state dict without them loads with these values.
    added_keys: dict = {}

    #: True when :meth:`_direction` is a function of ``m_tilde`` and the group only (it ignores
    #: ``p`` and ``state``, may be called with ``p = state = None``) and accepts a batch
    #: ``(..., m, n)`` returned in the group's ``ns_dtype``. Such directions can be computed by
    #: any rank and stacked. A subclass that overrides ``_direction`` without setting this
    #: attribute again is treated as stateful (computed on every rank, one matrix at a time).
    stateless_direction: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "_direction" in cls.__dict__ and "stateless_direction" not in cls.__dict__:
            cls.stateless_direction = False

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
        distributed: bool | str = "auto",
        batching: str = "auto",
        process_group=None,
        **extra,
    ):
        if not (isinstance(distributed, bool) or distributed == "auto"):
            raise ValueError(f"distributed: expected 'auto', True or False, got {distributed!r}")
        if batching not in BATCHING:
            raise ValueError(
                f"batching: unknown value {batching!r}; allowed: {', '.join(BATCHING)}"
            )
        self.distributed = distributed
        self.batching = batching
        self.process_group = process_group
        self._reset_caches()
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

    @property
    def workspace_bytes(self) -> int:
        """Scratch memory kept between steps (one matrix's temporaries; not optimizer state)."""
        return self._workspace.nbytes

    def _reset_caches(self) -> None:
        """Per-process scratch, rebuilt after a copy: nothing here is state."""
        self._checked_same_gradients = False
        self._workspace = Workspace()  # scratch of the per-matrix path, one matrix's worth

    def __getstate__(self) -> dict:
        # torch.optim pickles defaults, state and groups only; a copy must also know how to
        # execute (deepcopy and pickle go through here)
        return {**super().__getstate__(), "distributed": self.distributed,
                "batching": self.batching, "process_group": self.process_group}

    def __setstate__(self, state: dict) -> None:
        # Called by unpickling and deepcopy, and by load_state_dict with the loaded groups:
        # keys added after a state dict was written get the values of the older behaviour
        # (as torch.optim does for its own new keys), and older numeric steps become tensors.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.added_keys.items():
                group.setdefault(key, value)
        tensor_steps(self.state)
        if "_workspace" not in self.__dict__:
            self._reset_caches()

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
            self._init_state(p, group)

    def _init_state(self, p: Tensor, group: dict) -> None:
        """Create ``p``'s state (up front, so that every rank holds the same keys for
        distributed checkpoints; again on a step if it was reset)."""
        if group["use_muon"]:
            self._init_matrix_state(p, self.state[p], group)
        else:
            init_adamw_state(p, self.state[p])

    def _validate(self, group: dict) -> None:
        name = type(self).__name__
        check_group_keys(group, self.defaults, name)
        for key in ("lr", "weight_decay", "adamw_eps"):
            check_number(group, key)
        check_flag(group, "use_muon")
        check_betas(group, "adamw_betas")
        group["ns_dtype"] = dtype_name(group["ns_dtype"])  # one spelling in every group
        if not group["use_muon"]:
            return
        check_number(group, "momentum", high=1.0, high_open=True)
        check_flag(group, "nesterov")
        steps = group["ns_steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"ns_steps: expected an integer ≥ 0, got {steps!r}")
        group["ns_coefficients"] = normalize_coefficients(group["ns_coefficients"], steps)
        if group["lr_adjust"] not in LR_ADJUST:
            raise ValueError(
                f"lr_adjust: unknown value {group['lr_adjust']!r}; allowed: {', '.join(LR_ADJUST)}"
            )
        for p in group["params"]:
            if p.ndim < 2:
                raise ValueError(
                    f"{name}: a parameter of shape {tuple(p.shape)} is in a matrix "
                    "(use_muon=True) group; 0-D and 1-D tensors must go to a use_muon=False "
                    "(AdamW) group — muoneq.param_groups(model) routes them"
                )
            if p.is_complex():
                raise ValueError(
                    f"{name}: a complex parameter of shape {tuple(p.shape)} is in a matrix "
                    "(use_muon=True) group; orthogonalized updates are defined for real "
                    "matrices: put it in a use_muon=False (AdamW) group"
                )
        self._validate_extra(group)

    def _validate_extra(self, group: dict) -> None:
        """Check a subclass's own hyper-parameters (raise ``ValueError`` naming the key)."""

    # ----------------------------------------------------------------- state
    def _init_matrix_state(self, p: Tensor, state: dict, group: dict) -> None:
        """Persistent state of a matrix parameter: one momentum buffer (as Muon)."""
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ----------------------------------------------------------------- the update
    def _direction_flops(self, shape: tuple[int, int], group: dict) -> float:
        """FLOPs of one direction of a ``shape`` matrix (balances the split between ranks)."""
        return ns_flops(shape, group["ns_steps"])

    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        """Map the (Nesterov-mixed) momentum, viewed as a matrix, to the update direction.

        ``p``, ``m_tilde`` and ``state`` are whole (under FSDP2 the base class gathers them
        for methods that are not :attr:`stateless_direction`). ``m_tilde`` is scratch (the
        method may overwrite it); the returned tensor is consumed before the next call (it
        may live in a reused buffer).
        """
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Perform one optimization step; ``closure`` is evaluated with gradients enabled."""
        loss = evaluate_closure(closure)
        for group in self.param_groups:
            params = params_with_grads(group, type(self).__name__)
            if not params:
                continue
            for p in params:
                if not self.state[p]:  # reset by the user, or loaded without it
                    self._init_state(p, group)
            if isinstance(group["lr"], Tensor):  # read once per group and step
                group = {**group, "lr": scalar(group["lr"])}
            grads = [p.grad for p in params]
            if group["use_muon"]:
                self._matrix_step(params, grads, group)
            else:
                beta1, beta2 = group["adamw_betas"]
                adamw_update(
                    params, grads, [self.state[p] for p in params],
                    lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["adamw_eps"],
                    weight_decay=group["weight_decay"],
                )
        return loss

    def _matrix_step(self, params: list[Tensor], grads: list[Tensor], group: dict) -> None:
        """Momentum for every matrix, then directions by the path that fits the layout.

        Replicated parameters: computed here, or split between ranks (:attr:`distributed`).
        Row-sharded ``DTensor`` parameters (FSDP2): whole matrices are gathered on an owner
        rank, or on every rank for methods with state of their own.
        """
        slots = [
            MatrixSlot(p, local(p), local(g), local(self.state[p]["momentum_buffer"]),
                       matrix_shape(p))
            for p, g in zip(params, grads, strict=True)
        ]
        torch._foreach_lerp_(  # M ← βM + (1−β)G
            [s.momentum for s in slots], [s.grad for s in slots], 1 - group["momentum"]
        )
        replicated, sharded = [], {}
        for s in slots:
            dim = row_shard_dim(s.param)
            if dim is None:
                replicated.append(s)
            else:
                sharded.setdefault((id(s.param.device_mesh), dim), []).append(s)
        if replicated:
            self._replicated_step(replicated, group)
        for (_, dim), part in sharded.items():
            self._row_sharded_step(part, group, dim)

    def _m_tilde(self, slot: MatrixSlot, group: dict) -> Tensor:
        """This rank's ``M̃`` of a slot, in the workspace: consume it before the next call."""
        g = slot.grad
        out = self._workspace.take("m_tilde", g.shape, g.dtype, g.device)
        return slot.m_tilde(group["momentum"], group["nesterov"], out=out)

    def _whole_m_tilde(self, slot: MatrixSlot, group: dict) -> Callable[[], Tensor]:
        return lambda: self._m_tilde(slot, group).reshape(slot.shape)

    def _apply(self, slot: MatrixSlot, direction: Tensor, group: dict) -> None:
        """``X ← (1 − η·λ)X − a·η·direction`` on this rank's part of the parameter.

        A direction in another dtype is first cast into the (now free) ``M̃`` buffer: adding
        it directly would make torch allocate that cast for every matrix (same values).
        """
        lr, wd = group["lr"], group["weight_decay"]
        value = slot.value
        if wd != 0:
            value.mul_(1 - lr * wd)
        direction = direction.reshape(value.shape)
        if direction.dtype != value.dtype:
            buffer = self._workspace.take("m_tilde", value.shape, value.dtype, value.device)
            if buffer.untyped_storage().data_ptr() != direction.untyped_storage().data_ptr():
                direction = buffer.copy_(direction)
        value.add_(direction, alpha=-lr * lr_scale(slot.shape, group["lr_adjust"]))

    def _split_group(self):
        """The process group to split replicated matrices over, ``None`` to compute them here."""
        if not self.stateless_direction or self.distributed is False:
            return None
        if not (dist.is_available() and dist.is_initialized()):
            if self.distributed is True:
                raise RuntimeError(
                    "distributed=True: torch.distributed is not initialized; call "
                    "init_process_group first, or use distributed='auto' / False"
                )
            return None
        group = self.process_group or dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _replicated_step(self, slots: list[MatrixSlot], group: dict) -> None:
        def apply(slot: MatrixSlot, direction: Tensor) -> None:
            self._apply(slot, direction, group)

        thunks = [self._whole_m_tilde(s, group) for s in slots]
        pg = self._split_group()
        if pg is None:
            self._compute(list(zip(slots, thunks, strict=True)), group, apply)
            return
        if not self._checked_same_gradients:
            check_same_gradients(slots, pg)
            self._checked_same_gradients = True
        exchange_replicated(
            slots, thunks, lambda items, sink: self._compute(items, group, sink), apply,
            costs=[self._direction_flops(s.shape, group) for s in slots],
            dtype=resolve_dtype(group["ns_dtype"]), group=pg,
        )

    def _row_sharded_step(self, slots: list[MatrixSlot], group: dict, mesh_dim: int) -> None:
        def apply_rows(slot: MatrixSlot, rows: Tensor) -> None:
            self._apply(slot, rows, group)

        if self.stateless_direction:
            exchange_row_sharded(
                slots, [lambda s=s: self._m_tilde(s, group) for s in slots],
                lambda items, sink: self._compute(items, group, sink), apply_rows,
                costs=[self._direction_flops(s.shape, group) for s in slots],
                dtype=resolve_dtype(group["ns_dtype"]), mesh_dim=mesh_dim,
            )
            return
        # A method with state of its own: every rank computes every direction from whole
        # matrices (the parameter with its gradient, M̃ and the state), then keeps its rows.
        for s in slots:
            p = s.param
            whole_p = p.full_tensor()
            whole_p.grad = p.grad.full_tensor()
            m_tilde = full_tensor(p, self._m_tilde(s, group)).reshape(s.shape)
            state = self.state[p]
            whole_state = {k: v.full_tensor() if is_dtensor(v) else v
                           for k, v in state.items()}
            direction = self._direction(whole_p, m_tilde, whole_state, group)
            for k, v in whole_state.items():
                if is_dtensor(state.get(k)):
                    local(state[k]).copy_(local_part(state[k], v))
                else:
                    state[k] = v
            self._apply(s, local_part(p, direction.reshape(p.shape)), group)

    def _compute(self, items: list, group: dict, sink: Callable[[MatrixSlot, Tensor], None]):
        """Directions of ``(slot, whole-M̃ thunk)`` items computed on this rank, given to sink.

        Per matrix (CPU default: BLAS is at its peak on one matrix and each M̃ lives only for
        its own step), or, for stateless directions, as stacks of same-shape matrices in one
        batched call (GPU default: one launch per NS product for the whole stack).
        """
        if not (self.stateless_direction and self._stacked(items)):
            for slot, thunk in items:
                sink(slot, self._direction(slot.param, thunk(), self.state[slot.param], group))
            return
        buckets: dict[tuple, list] = {}
        for slot, thunk in items:
            key = (slot.shape, slot.grad.dtype, slot.grad.device)
            buckets.setdefault(key, []).append((slot, thunk))
        for (shape, dtype, device), bucket in buckets.items():
            per_stack = max(1, _STACK_ELEMENTS // math.prod(shape))
            for start in range(0, len(bucket), per_stack):
                chunk = bucket[start : start + per_stack]
                stack = torch.empty((len(chunk), *shape), dtype=dtype, device=device)
                for j, (_, thunk) in enumerate(chunk):
                    stack[j].copy_(thunk())
                directions = self._direction(None, stack, None, group)
                del stack
                for j, (slot, _) in enumerate(chunk):
                    sink(slot, directions[j])

    def _stacked(self, items: list) -> bool:
        if self.batching == "auto":
            return bool(items) and items[0][0].value.device.type != "cpu"
        return self.batching == "stacked"
