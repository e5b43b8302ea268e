"""Orthogonalized updates for matrix groups, AdamW for the rest: the base of MuonEq and Muon's
relatives.

One optimizer object serves a whole model. Each param group is either

* a *matrix* group (``use_muon=True``), stepped as Algorithm 1 with the method's own map from
  the momentum to a direction (:meth:`~HybridOrthogonalOptimizer._direction`; for MuonEq
  ``NS_K(DiagPre(M̃))``)::

      M ← βM + (1−β)G;   M̃ = βM + (1−β)G (Nesterov) or M          (lines 5–10)
      X ← (1 − η·λ)·X − a·η·direction(M̃)                          (line 13)

* or an AdamW group (``use_muon=False``): :func:`muoneq.optim.adamw.adamw_update`.

The step runs the engine (:mod:`muoneq.optim.engine`) on a plan made once: the matrix groups'
momentum lives in banks (one tensor per stored shape, the state's buffers are views of it),
and a group whose matrices are stacked (the accelerator default) is stepped as chunks of
same-shape matrices, each a handful of batched operations (gather, prologue, Newton–Schulz,
epilogue); otherwise, as ``torch.optim.Muon.step`` runs ``muon()``, the momentum update (line 5,
one foreach call) then :func:`muoneq.optim.engine.directions` one matrix at a time (lines 6–13),
every method orthogonalizing through the group's validated Newton–Schulz
(:meth:`~HybridOrthogonalOptimizer._orthogonalizer`).

A subclass writes its constructor with its own keywords (the shared ones come as
``**shared: Unpack[Shared]``) and hands them on as ``dict(...)``, declares how its own
hyper-parameters are checked (:class:`~muoneq.optim.base.Hyper`), overrides :meth:`_direction`, and
:meth:`_init_matrix_state` when it keeps state beyond the momentum.
Parameters with more than two dimensions (conv filters) are viewed as ``(out, in·kh·kw)``;
the group keys ``transposed``, ``batch_dims`` and ``splits`` describe other stored layouts
(:class:`muoneq.layout.MatrixLayout`; :func:`muoneq.param_groups` sets them from the model's
layers).

On one process the directions are computed one matrix at a time (the CPU default) or as
stacks of same-shape matrices (the accelerator default); the DDP split and FSDP2's row shards
are :mod:`muoneq.optim.executors`' business. Every path gives the one-process result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, TypedDict, Unpack

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.functional import LR_ADJUST, UpdateSettings
from muoneq.layout import MatrixLayout, check_splits
from muoneq.newton_schulz import (
    Backend,
    Coefficients,
    Workspace,
    canonical_backend,
    dtype_name,
    normalize_coefficients,
    ns_flops,
    orthogonalizer,
    resolve_dtype,
    run_schedule,
)
from muoneq.optim import executors
from muoneq.optim.adamw import adamw_update, init_adamw_state
from muoneq.optim.base import Hyper, OptimizerBase, refuse_unknown
from muoneq.optim.checks import (
    betas,
    boolean,
    choice,
    converted,
    decay,
    integer,
    nonnegative,
    scalar,
)
from muoneq.optim.engine import (
    Chunk,
    DirectionRule,
    GroupPlan,
    GroupUpdate,
    MatrixSlot,
    StackSettings,
    StateShapes,
    bank_state,
    carve,
    directions,
    local,
    plan_stacks,
    step_stacks,
)
from muoneq.optim.executors import row_shard_dim

BATCHING = ("auto", "per_matrix", "stacked")


class Shared(TypedDict, total=False):
    """The keywords every matrix optimizer here takes, declared once: each constructor names
    its own keywords and takes these as ``**shared: Unpack[Shared]`` (which IDEs and type
    checkers read). Their meaning: :class:`muoneq.MuonEq`'s docstring; their defaults:
    :data:`SHARED_DEFAULTS` (a method's own: its ``shared_defaults``)."""

    lr: float | Tensor
    momentum: float
    nesterov: bool
    weight_decay: float
    ns_steps: int
    ns_coefficients: Coefficients
    ns_dtype: str | torch.dtype
    lr_adjust: str
    adamw_betas: tuple[float, float]
    adamw_eps: float
    distributed: bool | str
    batching: str
    workspace_limit: int | None
    ns_backend: Backend
    process_group: dist.ProcessGroup | None


#: The defaults of :class:`Shared`.
SHARED_DEFAULTS = Shared(
    lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5,
    ns_coefficients="quintic", ns_dtype="auto", lr_adjust="rms", adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8, distributed="auto", batching="auto", workspace_limit=None,
    ns_backend="torch", process_group=None,
)
#: The keywords of :class:`Shared` that choose how, not what, is computed: options kept by the
#: optimizer (and its copies), not param-group keys.
OPTIONS = ("distributed", "batching", "workspace_limit", "ns_backend", "process_group")


class HybridOrthogonalOptimizer(OptimizerBase):
    """Base class: orthogonalized updates for matrix groups, AdamW for the rest.

    Hyper-parameters (constructor keywords and per-group keys): ``lr``, ``momentum``,
    ``nesterov``, ``weight_decay``, ``ns_steps``, ``ns_coefficients``, ``ns_dtype``,
    ``lr_adjust``, ``adamw_betas``, ``adamw_eps`` (see :class:`muoneq.MuonEq`), and the group
    key ``use_muon`` (default True). Group keys describing how the group's matrices are stored
    (:class:`muoneq.layout.MatrixLayout`; :func:`muoneq.param_groups` sets them):

    * ``transposed`` (default False): stored as ``(in, out, …)`` — ``transformers``' ``Conv1D``,
      transposed convolutions — and updated as the ``(out, in·…)`` matrix;
    * ``batch_dims`` (default 0): leading dimensions that index separate matrices (MoE expert
      banks ``(experts, out, in)``);
    * ``splits`` (default None): row counts of the blocks of a fused weight (Q, K, V;
      gate, up), each equilibrated, orthogonalized and scaled as a matrix of its own
      (stateless directions only).

    Options of how, not what, is computed:

    * ``distributed``: ``"auto"`` (default) splits the matrices of a step between the ranks of
      ``process_group`` (default: the world) when ``torch.distributed`` is initialized with more
      than one rank and the parameters are replicated (DDP); ``False`` makes every rank compute
      every matrix; ``True`` is ``"auto"`` that raises if no process group is initialized.
      Row-sharded ``DTensor`` parameters (FSDP2) always gather whole matrices, whatever the
      setting. Only methods whose :attr:`stateless_direction` is true can be split.
    * ``batching``: ``"per_matrix"`` (one matrix at a time), ``"stacked"`` (same-shape matrices
      in one batched call) or ``"auto"`` (default): stacked on accelerators, per matrix on CPU.
    * ``workspace_limit``: bytes of scratch the stacked path keeps (:attr:`workspace_bytes`),
      bounded by stacking fewer matrices per call (``None``: up to
      :data:`~muoneq.optim.executors.STACK_ELEMENTS` elements).
    """

    hyperparameters = {
        "lr": Hyper(nonnegative),
        "momentum": Hyper(decay, when="use_muon"),
        "nesterov": Hyper(boolean, when="use_muon"),
        "weight_decay": Hyper(nonnegative),
        "ns_steps": Hyper(integer(1), when="use_muon"),
        "ns_coefficients": Hyper(lambda key, value, group: normalize_coefficients(
            value, group["ns_steps"]), when="use_muon"),
        # "auto": bf16 on accelerators and CPUs that multiply it natively, else float32; one
        # spelling in every group
        "ns_dtype": Hyper(converted(dtype_name)),
        "lr_adjust": Hyper(choice(*LR_ADJUST), when="use_muon"),
        "adamw_betas": Hyper(betas),
        "adamw_eps": Hyper(nonnegative),
        "use_muon": Hyper(boolean),
        # how the group's parameters are stored (muoneq.layout): group keys, not arguments
        "transposed": Hyper(boolean, when="use_muon"),
        "batch_dims": Hyper(integer(0), when="use_muon"),
        "splits": Hyper(check_splits, when="use_muon"),
    }
    added_keys = {"transposed": False, "batch_dims": 0, "splits": None}

    #: True when :meth:`_direction` is a function of ``m_tilde`` and the group only: such
    #: directions can be computed by any rank and stacked.
    stateless_direction: ClassVar[bool] = False
    #: The method's own defaults of :class:`Shared` keywords (Mousse's ``nesterov=False``),
    #: over :data:`SHARED_DEFAULTS`.
    shared_defaults: ClassVar[Shared] = Shared()
    #: State of a method's own kept per matrix in banks like the momentum (key → its
    #: :class:`~muoneq.optim.engine.Banked` shape and dtype), so that the stacked path's
    #: ``prepare`` and ``finish`` read it stacked.
    banked_state: ClassVar[StateShapes] = {}

    @classmethod
    def shared_keywords(cls) -> dict[str, tuple[Any, Any]]:
        defaults = {**SHARED_DEFAULTS, **cls.shared_defaults}
        # annotations as written (``from __future__ import annotations``: TypedDict keeps them
        # as forward references)
        return {name: (getattr(annotation, "__forward_arg__", annotation), defaults[name])
                for name, annotation in Shared.__annotations__.items()}

    def __init__(self, params: ParamsT, method_defaults: dict[str, Any] | None = None,
                 **shared: Unpack[Shared]):
        """``method_defaults``: a subclass's own hyper-parameters, ``dict(beta2=beta2, …)``."""
        unknown = {k: v for k, v in shared.items() if k not in SHARED_DEFAULTS}
        refuse_unknown(type(self), unknown)
        given = {**SHARED_DEFAULTS, **self.shared_defaults, **shared}
        distributed, batching = given["distributed"], given["batching"]
        workspace_limit = given["workspace_limit"]
        if not (isinstance(distributed, bool) or distributed == "auto"):
            raise ValueError(f"distributed: expected 'auto', True or False, got {distributed!r}")
        if batching not in BATCHING:
            raise ValueError(
                f"batching: unknown value {batching!r}; allowed: {', '.join(BATCHING)}"
            )
        if workspace_limit is not None and (isinstance(workspace_limit, bool) or not isinstance(
                workspace_limit, int) or workspace_limit < 0):
            raise ValueError("workspace_limit: expected None or a number of bytes ≥ 0, got "
                             f"{workspace_limit!r}")
        self.distributed = distributed
        self.batching = batching
        self.workspace_limit = workspace_limit
        self.ns_backend = canonical_backend(given["ns_backend"])
        self.process_group = given["process_group"]
        defaults = dict(lr=given["lr"], momentum=given["momentum"], nesterov=given["nesterov"],
                        weight_decay=given["weight_decay"], ns_steps=given["ns_steps"],
                        ns_coefficients=given["ns_coefficients"], ns_dtype=given["ns_dtype"],
                        lr_adjust=given["lr_adjust"], adamw_betas=given["adamw_betas"],
                        adamw_eps=given["adamw_eps"], use_muon=True, transposed=False,
                        batch_dims=0, splits=None, **(method_defaults or {}))
        super().__init__(params, defaults)
        if self.ns_backend == "triton":
            self._check_triton()

    def _options(self) -> dict:
        return {"distributed": self.distributed, "batching": self.batching,
                "workspace_limit": self.workspace_limit, "ns_backend": self.ns_backend,
                "process_group": self.process_group}

    def _check_triton(self) -> None:
        """``ns_backend="triton"`` needs triton, and CUDA tensors (or Triton's interpreter)
        and a Newton–Schulz dtype its kernels take, in every matrix group."""
        try:
            from muoneq import ns_triton
        except ImportError:
            raise ValueError("ns_backend='triton': triton is not installed "
                             "(pip install triton), or use ns_backend='torch'") from None
        for group in self.param_groups:
            if group["use_muon"] and group["params"]:
                device = group["params"][0].device
                probe = torch.empty(0, dtype=resolve_dtype(group["ns_dtype"], device),
                                    device=device)
                ns_triton.check_tensor(probe)

    def _reset_caches(self) -> None:
        self._checked_same_gradients = False
        self._workspace = Workspace()  # scratch of the per-matrix path, one matrix's worth
        self._stack_workspace = Workspace()  # buffers of the stacked path, one chunk's worth
        self._compiled = None  # a torch.compile'd run_schedule (MuonEq(compile=True))
        self._orthogonalizers: dict[tuple, Callable[..., Tensor]] = {}
        self._plans: list[GroupPlan | None] = []  # one per param group (None: AdamW)
        self._stacks: tuple[tuple, dict[int, tuple[StackSettings, list[Chunk]]]] | None = None

    @property
    def workspace_bytes(self) -> int:
        """Scratch memory kept between steps, not optimizer state: the stacked path's buffers as
        planned (at most ``workspace_limit`` where one parameter per chunk allows; planned now
        if no step has run yet) and the copies of banks staged into them (weights stored
        transposed or as blocks, parameters below float32 with Nesterov), and the per-matrix
        path's temporaries (one matrix's)."""
        stacks = self._planned()
        staged = {id(s.bank): s.bank.gather for _, chunks in stacks.values() for c in chunks
                  for s in c.segments if s.bank.gather is not None}
        return (self._workspace.nbytes + self._stack_workspace.nbytes
                + sum(t.numel() * t.element_size() for t in staged.values()))

    def _validate(self, group: dict) -> None:
        super()._validate(group)
        if not group["use_muon"]:
            return
        name = type(self).__name__
        names = group.get("param_names") or [None] * len(group["params"])
        for p, pname in zip(group["params"], names, strict=True):
            which = f"{pname!r} (shape {tuple(p.shape)})" if pname else \
                f"a parameter of shape {tuple(p.shape)}"
            if p.ndim < 2:
                raise ValueError(
                    f"{name}: {which} is in a matrix (use_muon=True) group; 0-D and 1-D "
                    "tensors must go to a use_muon=False (AdamW) group — "
                    "muoneq.param_groups(model) routes them"
                )
            if p.is_complex():
                raise ValueError(
                    f"{name}: complex {which} is in a matrix (use_muon=True) group; "
                    "orthogonalized updates are defined for real matrices: put it in a "
                    "use_muon=False (AdamW) group"
                )
            try:
                layout = MatrixLayout.of(p, group)
            except ValueError as err:
                if pname is None:
                    raise
                raise ValueError(f"{err} (parameter {pname!r})") from None
            if len(layout.blocks) > 1 and not self.stateless_direction:
                raise ValueError(
                    f"splits/batch_dims: {name} keeps state per matrix parameter, so {which} "
                    f"must be one matrix (got {layout.describe()}); split fused weights with "
                    "MuonEq or Muon, or leave splits=None and batch_dims=0"
                )

    # ----------------------------------------------------------------- state
    def _init_group(self, group: dict) -> None:
        if not group["use_muon"]:
            super()._init_group(group)
        self._plans.append(self._plan_group(group) if group["use_muon"] else None)
        self._stacks = None

    def _plan_group(self, group: dict) -> GroupPlan:
        """Bank the momentum of a matrix group (:mod:`muoneq.optim.engine`), creating the state
        of every parameter that has none (new, reset, or loaded without it)."""
        params = group["params"]
        missing = [p for p in params if not self.state[p]]
        layouts = [MatrixLayout.of(p, group) for p in params]
        banks = bank_state(params, layouts, self.state, self.banked_state)
        for p in missing:
            self._init_state(p, group)
        return GroupPlan.of(params, layouts, banks, self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; the loaded momentum is then copied
        into this optimizer's banks (the given state dict is left as it was)."""
        super().load_state_dict(state_dict)
        self._plans = [self._plan_group(g) if g["use_muon"] else None for g in self.param_groups]
        self._stacks = None

    def _init_state(self, p: Tensor, group: dict) -> None:
        if group["use_muon"]:
            self._init_matrix_state(p, self.state[p], group)
        else:
            init_adamw_state(p, self.state[p], capturable=group.get("capturable", False))

    def _init_matrix_state(self, p: Tensor, state: dict, group: dict) -> None:
        """Persistent state of a matrix parameter: one momentum buffer (as Muon), in the
        stored layout (state of a method's own is kept in the matrix view,
        ``MatrixLayout.of(p, group).matrix``). Parameters of one stored shape share one
        momentum tensor (a bank, :mod:`muoneq.optim.engine`); each holds a view of it."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    # ----------------------------------------------------------------- the update
    def _direction(self, p: Tensor, m_tilde: Tensor, state: dict, group: dict) -> Tensor:
        """Map the (Nesterov-mixed) momentum, viewed as a matrix, to the update direction.

        ``m_tilde`` is one ``(out, in·…)`` matrix (a block of ``p`` when its group has
        ``splits`` or ``batch_dims``), whatever ``p``'s stored layout. ``p``, ``m_tilde`` and
        ``state`` are whole (under FSDP2 they are gathered for methods that are not
        :attr:`stateless_direction`). ``m_tilde`` is scratch (the method may overwrite it); the
        returned tensor is consumed before the next call (it may live in a reused buffer).
        """
        raise NotImplementedError

    def _direction_flops(self, shape: tuple[int, int], group: dict) -> float:
        """FLOPs of one direction of a ``shape`` matrix (balances the split between ranks)."""
        return ns_flops(shape, group["ns_steps"])

    def _orthogonalizer(self, group: dict, device: torch.device) -> Callable[..., Tensor]:
        """The group's Newton–Schulz, validated once per setting (not per matrix and step):
        ``orthogonalize(G, workspace=None)``, :func:`muoneq.newton_schulz.orthogonalizer` of
        the group's ``ns_steps``, ``ns_coefficients``, ``ns_dtype`` (on ``device``) and
        ``ns_algorithm``. Every method here orthogonalizes through it."""
        key = (group["ns_steps"], group["ns_coefficients"], group["ns_dtype"],
               group.get("ns_algorithm", "standard"), torch.device(device).type)
        found = self._orthogonalizers.get(key)
        if found is None:
            found = self._orthogonalizers[key] = orthogonalizer(
                *key[:4], device=device, run=self._compiled or run_schedule,
                backend=self.ns_backend)
        return found

    def _rule(self, group: dict, device: torch.device, stacked: bool) -> DirectionRule:
        """How the group's directions are computed: the method's own :meth:`_direction`
        (MuonEq's stages override this)."""
        return DirectionRule(direction=functools.partial(self._direction, group=group),
                             state=self.state.__getitem__, stacked=stacked,
                             stack_elements=executors.STACK_ELEMENTS, workspace=self._workspace)

    @torch.no_grad()
    def step(self, closure=None):
        """One step: Algorithm 1 for every matrix group, AdamW for the others; ``closure`` is
        evaluated first, with gradients enabled, and its loss returned."""
        loss = self._evaluate(closure)
        stacks = self._planned()
        for index, group in enumerate(self.param_groups):
            if group["use_muon"]:
                self._step_matrices(group, self._plans[index], stacks.get(index))
                continue
            prepared = self._group_to_step(group)
            if prepared is not None:
                group, params = prepared
                beta1, beta2 = group["adamw_betas"]
                adamw_update(params, [p.grad for p in params], [self.state[p] for p in params],
                             lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["adamw_eps"],
                             weight_decay=group["weight_decay"],
                             capturable=group.get("capturable", False))
        return loss

    def _planned(self) -> dict[int, tuple[StackSettings, list[Chunk]]]:
        """Check the plans (Python only: no tensor is touched unless something changed) and
        return the stacks of the groups that take the stacked path, planned again when a
        group, its state or a setting they depend on changed."""
        plans = self._plans
        if len(plans) != len(self.param_groups):
            plans = self._plans = [None] * len(self.param_groups)
        for index, group in enumerate(self.param_groups):
            plan = plans[index]
            if group["use_muon"] and (plan is None or
                                      not plan.matches(group["params"], self.state)):
                plans[index] = self._plan_group(group)
                self._stacks = None
        split = self._split_group()  # DDP: the executors split the matrices, no stacks here
        wanted = tuple((index, self._stack_settings(group, plan))
                       for index, (group, plan) in enumerate(zip(self.param_groups, plans,
                                                                 strict=True))
                       if plan is not None and plan.params and plan.replicated and split is None)
        key = (wanted, executors.STACK_ELEMENTS, self.workspace_limit)
        if self._stacks is None or self._stacks[0] != key:
            self._stack_workspace, stacks = self._plan_stacks(plans, wanted)
            for settings, chunks in stacks.values():
                carve(chunks, settings, self._stack_workspace)
            self._stacks = (key, stacks)
        return self._stacks[1]

    def _plan_stacks(self, plans: list[GroupPlan | None], wanted: tuple) -> tuple[Workspace, dict]:
        """The chunks of every stacked group, their buffers reserved in one workspace that the
        chunks share (each buffer as large as its largest chunk's) and that holds at most
        ``workspace_limit`` bytes where chunks of one parameter allow: the bytes a chunk may
        take are lowered until the workspace fits."""
        limit = chunk_bytes = self.workspace_limit
        while True:
            workspace = Workspace()
            stacks = {index: (settings, plan_stacks(plans[index], settings,
                                                    executors.STACK_ELEMENTS, workspace,
                                                    chunk_bytes))
                      for index, settings in wanted if settings is not None}
            planned = workspace.reserved_bytes
            several = any(len(c.segments) > 1 or c.segments[0].hi - c.segments[0].lo > 1
                          for _, chunks in stacks.values() for c in chunks)
            if limit is None or planned <= limit or not several:
                return workspace, stacks
            chunk_bytes = min(chunk_bytes * limit // planned, chunk_bytes * 15 // 16)

    @property
    def planned_backends(self) -> dict[tuple[int, int], str]:
        """The Newton–Schulz backend of each shape of matrices the stacked path steps, as
        planned at the last step (``ns_backend="auto"`` chooses per shape)."""
        stacks = {} if self._stacks is None else self._stacks[1]
        return {chunk.shape: chunk.backend for _, chunks in stacks.values() for chunk in chunks}

    def _stack_settings(self, group: dict, plan: GroupPlan) -> StackSettings | None:
        """What the stacked path of :mod:`muoneq.optim.engine` needs of a group, ``None`` where
        it does not apply (the method's rule is one matrix at a time). A method whose rule is a
        batched ``prepare``, DiagPre (or nothing), Newton–Schulz and a batched ``finish``
        returns :meth:`_stacked_settings` (every method here)."""
        return None

    def _stacked_settings(self, group: dict, plan: GroupPlan, mode: str,
                          finish: Callable | None = None,
                          prepare: Callable | None = None) -> StackSettings | None:
        """The stacked path's settings for a group whose matrices are stacked (``batching``),
        with ``prepare`` and ``mode`` DiagPre before Newton–Schulz and ``finish`` after it
        (:class:`~muoneq.optim.engine.StackSettings`; ``compile=True`` compiles each chunk's
        prologue and update)."""
        device = plan.params[0].device
        if not self._stacked(device):
            return None
        orthogonalize = self._orthogonalizer(group, device)
        return StackSettings(mode, group["nesterov"], orthogonalize.keywords["dtype"],
                             orthogonalize.keywords["schedule"],
                             group.get("ns_algorithm", "standard"), group["lr_adjust"],
                             self.ns_backend, compile=self._compiled is not None,
                             prepare=prepare, finish=finish)

    def _stacked(self, device: torch.device) -> bool:
        """Whether the group's matrices are stacked (``batching``; ``"auto"``: off the CPU)."""
        return self.batching == "stacked" or (self.batching == "auto" and device.type != "cpu")

    def _step_matrices(self, group: dict, plan: GroupPlan,
                       stacks: tuple[StackSettings, list[Chunk]] | None) -> None:
        """Lines 5–13 for a matrix group: planned stacks when every parameter has a gradient
        and this process computes every matrix, else the per-slot path and the executors."""
        grads = [p.grad for p in plan.params]
        present = [g is not None for g in grads]
        if not any(present):
            return
        if any(g.is_sparse for g in grads if g is not None):
            raise self._sparse_error()
        capturable = group.get("capturable", False)
        settings = UpdateSettings(lr=group["lr"] if capturable else scalar(group["lr"]),
                                  weight_decay=group["weight_decay"],
                                  momentum=group["momentum"], nesterov=group["nesterov"],
                                  lr_adjust=group["lr_adjust"])
        if stacks is not None and all(present) and self._split_group() is None:
            stack, chunks = stacks
            step_stacks(plan, chunks, grads, settings, stack, eps=group.get("eps", 0.0),
                        workspace=self._stack_workspace)
            return
        if capturable:
            raise RuntimeError(
                "capturable=True: this step cannot take the stacked path (it needs every "
                "matrix of the group with a gradient, one process computing them all, plain "
                "tensors, batching='stacked' or an accelerator); use capturable=False"
            )
        slots = [slot if slot is not None else
                 MatrixSlot(p, local(p), local(self.state[p]["momentum_buffer"]), layout)
                 for slot, p, layout, ok in zip(plan.slots, plan.params, plan.layouts, present,
                                                strict=True) if ok]
        torch._foreach_lerp_([s.momentum for s in slots], [s.grad for s in slots],
                             1 - group["momentum"])  # line 5: M ← βM + (1−β)G
        replicated = [s for s in slots if row_shard_dim(s.param) is None]
        update = self._update(group, settings, replicated or slots)
        split = self._split_group() if replicated else None
        if split is None:  # lines 6–13 for every matrix, on this process
            directions([(s, update.whole_m_tilde(s)) for s in replicated], update.rule,
                       update.apply)
        else:
            if not self._checked_same_gradients:
                executors.check_same_gradients(replicated, split)
                self._checked_same_gradients = True
            executors.split_replicated(replicated, update, split,
                                       self._costs(replicated, group))
        self._step_row_shards([s for s in slots if row_shard_dim(s.param) is not None],
                              group, settings)

    def _update(self, group: dict, settings: UpdateSettings,
                slots: list[MatrixSlot]) -> GroupUpdate:
        """What the per-slot path and the executors need of ``group`` this step."""
        device = slots[0].value.device
        stacked = self.stateless_direction and self._stacked(device)
        return GroupUpdate(settings, self._rule(group, device, stacked),
                           resolve_dtype(group["ns_dtype"], device), self._workspace)

    def _costs(self, slots: list[MatrixSlot], group: dict) -> list[float]:
        """FLOPs of each slot's directions (the sum over its blocks): what owners balance."""
        return [sum(self._direction_flops(shape, group) for shape in s.layout.blocks)
                for s in slots]

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

    def _step_row_shards(self, slots: list[MatrixSlot], group: dict,
                         settings: UpdateSettings) -> None:
        """FSDP2: whole matrices gathered on an owner rank, or on every rank for methods with
        state of their own."""
        by_mesh: dict[tuple, list[MatrixSlot]] = {}
        for s in slots:
            by_mesh.setdefault((id(s.param.device_mesh), row_shard_dim(s.param)), []).append(s)
        for (_, dim), part in by_mesh.items():
            update = self._update(group, settings, part)
            if self.stateless_direction:
                executors.gather_row_shards(part, update, dim, self._costs(part, group))
            else:
                executors.gather_whole(part, update)
