"""Orthogonalized updates for matrix groups, AdamW for the rest: the base of MuonEq and Muon's
relatives.

One optimizer object serves a whole model. Each param group is either

* a *matrix* group (``use_muon=True``), stepped as Algorithm 1 with the method's own rule
  around Newton–Schulz (:meth:`~HybridOrthogonalOptimizer.prepare` before it,
  :meth:`~HybridOrthogonalOptimizer.finish` after it; for MuonEq DiagPre of ``mode``)::

      M ← βM + (1−β)G;   M̃ = βM + (1−β)G (Nesterov) or M          (lines 5–10)
      X ← (1 − η·λ)·X − a·η·finish(NS_K(DiagPre(prepare(M̃))))    (lines 11–13)

* or an AdamW group (``use_muon=False``): :func:`muoneq.optim.adamw.adamw_update`.

As ``torch.optim.Muon.step`` calls ``muon()``, :meth:`~HybridOrthogonalOptimizer.step` gathers
each matrix group's lists and calls :func:`muoneq.functional.step_stacks` on the group's plan
(:mod:`muoneq.optim.plan`: momentum banks, chunks of same-shape matrices and their buffers,
made once) — or, when the matrices are split between DDP ranks or sharded by FSDP2, its
distributed form (:mod:`muoneq.optim.distributed`), which runs the same functions on the
matrices a rank owns.

A method is one small class: its constructor names its own keywords (the shared ones come as
``**shared: Unpack[Shared]``) and hands them on as ``dict(...)``, its ``hyperparameters`` table
says how they are checked (:class:`~muoneq.optim.base.Hyper`), ``prepare`` and ``finish`` are
its rule on stacks (a single matrix is a stack of one), writing into the scratch its
``requests`` name, and ``banked_state`` the state it keeps beyond the momentum.
Parameters with more than two dimensions (conv filters) are viewed as ``(out, in·kh·kw)``;
the group keys ``transposed``, ``batch_dims`` and ``splits`` describe other stored layouts
(:class:`muoneq.layout.MatrixLayout`; :func:`muoneq.param_groups` sets them from the model's
layers).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar, TypedDict, Unpack

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import ParamsT

from muoneq.functional import LR_ADJUST, add_directions, prologue, step_stacks
from muoneq.layout import MatrixLayout, check_splits
from muoneq.newton_schulz import (
    Backend,
    Coefficients,
    Request,
    Workspace,
    canonical_backend,
    dtype_name,
    normalize_coefficients,
    ns_settings,
    resolve_dtype,
)
from muoneq.optim import distributed
from muoneq.optim import plan as planning
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
from muoneq.optim.plan import (
    GroupPlan,
    GroupStep,
    Segment,
    StackSettings,
    StateShapes,
    bank_state,
    carve,
    compiled_copy,
    local,
    muon_step_bytes,
    plan_workspace,
    promoted,
)

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
    workspace_limit: int | str | None
    ns_backend: Backend
    process_group: dist.ProcessGroup | None


#: The defaults of :class:`Shared`.
SHARED_DEFAULTS = Shared(
    lr=1e-3, momentum=0.95, nesterov=True, weight_decay=0.1, ns_steps=5,
    ns_coefficients="quintic", ns_dtype="auto", lr_adjust="rms", adamw_betas=(0.9, 0.95),
    adamw_eps=1e-8, distributed="auto", batching="auto", workspace_limit="auto",
    ns_backend="torch", process_group=None,
)
#: The keywords of :class:`Shared` that choose how, not what, is computed: options kept by the
#: optimizer (and its copies), not param-group keys.
OPTIONS = ("distributed", "batching", "workspace_limit", "ns_backend", "process_group")
#: The group keys a matrix group's chunks depend on (:class:`~muoneq.optim.plan.StackSettings`),
#: with the value a group without the key has.
PLANNED_KEYS = {"mode": "none", "nesterov": None, "ns_steps": None, "ns_coefficients": None,
                "ns_dtype": None, "ns_algorithm": "standard", "lr_adjust": None}
#: ``workspace_limit="auto"``: this many times the extra memory ``torch.optim.Muon``'s step
#: takes for the largest matrix (:func:`~muoneq.optim.plan.muon_step_bytes`).
AUTO_WORKSPACE_OVER_MUON = 2


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
      (methods without :attr:`banked_state` only).

    Options of how, not what, is computed:

    * ``distributed``: ``"auto"`` (default) splits the matrices of a step between the ranks of
      ``process_group`` (default: the world) when ``torch.distributed`` is initialized with more
      than one rank and the parameters are replicated (DDP); ``False`` makes every rank compute
      every matrix; ``True`` is ``"auto"`` that raises if no process group is initialized.
      Row-sharded ``DTensor`` parameters (FSDP2) always gather whole matrices, whatever the
      setting; replicated ``DTensor`` parameters are split as replicated tensors are.
    * ``batching``: ``"per_matrix"`` (one matrix at a time), ``"stacked"`` (same-shape matrices
      in one batched call) or ``"auto"`` (default): stacked on accelerators, per matrix on CPU.
    * ``workspace_limit``: bytes of scratch the stacked path keeps (:attr:`workspace_bytes`),
      bounded by stacking fewer matrices per call (``None``: up to
      :data:`~muoneq.optim.plan.STACK_ELEMENTS` elements).
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

    #: ``torch.compile`` each chunk's prologue and update (MuonEq's ``compile=True``)
    compile: bool = False
    #: :meth:`finish` returns Newton–Schulz's dtype (the default ``finish``, or one that works
    #: in it), not the float32 a method's own arithmetic gives: what the directions travel in
    #: between ranks (so that nothing rounds twice)
    finishes_in_ns_dtype: ClassVar[bool] = True
    #: The method's own defaults of :class:`Shared` keywords (Mousse's ``nesterov=False``),
    #: over :data:`SHARED_DEFAULTS`.
    shared_defaults: ClassVar[Shared] = Shared()
    #: State of a method's own kept per matrix in banks like the momentum (key → its
    #: :class:`~muoneq.optim.plan.Banked` shape, dtype and initial value), so that ``prepare``
    #: and ``finish`` read it stacked (``segment.state``). Laid out as the momentum is (whole on
    #: every DDP rank, by rows under FSDP2), it is updated by each matrix's owner and travels
    #: with the matrix's rows (:mod:`muoneq.optim.distributed`).
    banked_state: ClassVar[StateShapes] = {}
    #: ``prepare`` reads the gradients (``segment.gradient``; whole matrices under FSDP2 too)
    reads_gradient: ClassVar[bool] = False

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
        if workspace_limit not in (None, "auto") and (
                isinstance(workspace_limit, bool) or not isinstance(workspace_limit, int)
                or workspace_limit < 0):
            raise ValueError("workspace_limit: expected 'auto', None or a number of bytes ≥ 0, "
                             f"got {workspace_limit!r}")
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
        self._workspace = Workspace()  # the chunks' buffers, the largest chunk's of each name
        #: ``torch.compile``'d prologue and update of each chunk shape (``compile=True``)
        self._compiled: dict[tuple[str, tuple[int, int]], Callable] = {}
        self._plans: list[GroupPlan | None] = []  # one per param group (None: AdamW)
        self._steps: tuple[tuple, dict[int, GroupStep]] | None = None
        #: each matrix group's settings at the last step and what they were made from
        self._settings: dict[int, tuple[tuple, StackSettings]] = {}

    @property
    def workspace_bytes(self) -> int:
        """Scratch memory kept between steps, not optimizer state: the chunks' buffers as
        planned, the method's scratch (:meth:`requests`) included (at most ``workspace_limit``
        where one parameter per chunk allows; planned now if no step has run yet), the copies
        of banks staged into them (weights stored transposed or as blocks, parameters below
        float32 with Nesterov, FSDP2's whole matrices, and their state and gradients where the
        method keeps or reads them) and the buffers a distributed step exchanges."""
        steps = self._planned()
        staged = {id(s.bank): s.bank.gather for step in steps.values()
                  for c in step.chunks + step.exchanged for s in c.segments
                  if s.bank.gather is not None}
        wires = [t for step in steps.values() if step.exchange is not None
                 for t in step.exchange.buffers]
        return self._workspace.nbytes + sum(t.numel() * t.element_size()
                                            for t in [*staged.values(), *wires])

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
            if len(layout.blocks) > 1 and self.banked_state:
                raise ValueError(
                    f"splits/batch_dims: {name} keeps state per matrix parameter, so {which} "
                    f"must be one matrix (got {layout.describe()}); split fused weights with "
                    "MuonEq or Muon, or leave splits=None and batch_dims=0"
                )
        distributed.check_layouts(group["params"])

    # ----------------------------------------------------------------- state
    def _init_group(self, group: dict) -> None:
        if not group["use_muon"]:
            super()._init_group(group)
        self._plans.append(self._plan_group(group) if group["use_muon"] else None)
        self._steps = None

    def _plan_group(self, group: dict) -> GroupPlan:
        """Bank the state of a matrix group (:mod:`muoneq.optim.plan`): every parameter's
        momentum (as Muon's, in the stored layout) and :attr:`banked_state`, created at their
        initial values where missing (new, reset, or loaded without it). Parameters of one
        stored shape share one tensor per key (a bank); each parameter's state holds a view."""
        params = group["params"]
        layouts = [MatrixLayout.of(p, group) for p in params]
        banks = bank_state(params, layouts, self.state, self.banked_state)
        return GroupPlan.of(params, layouts, banks, self.state)

    def load_state_dict(self, state_dict: dict) -> None:
        """As :meth:`muoneq.optim.base.OptimizerBase.load_state_dict`; the loaded momentum is
        then copied into this optimizer's banks (the given state dict is left as it was)."""
        super().load_state_dict(state_dict)
        self._plans = [self._plan_group(g) if g["use_muon"] else None for g in self.param_groups]
        self._steps = None

    def _init_state(self, p: Tensor, group: dict) -> None:
        """AdamW's state (a matrix group's is banked by its plan: :meth:`_plan_group`)."""
        init_adamw_state(p, self.state[p], capturable=group.get("capturable", False))

    # ----------------------------------------------------------------- the method's rule
    def requests(self, count: int, shape: tuple[int, int], dtype: torch.dtype
                 ) -> list[Request]:
        """The scratch :meth:`prepare` and :meth:`finish` write, ``(name, shape, dtype)``, for a
        chunk of ``count`` matrices of ``shape`` whose parameters have ``dtype``: reserved once
        by the plan (and bounded with it by ``workspace_limit``), seen by each segment as its
        rows (``segment.scratch[name]``; a 0-d buffer whole). Default: none."""
        return []

    def prepare(self, M: Tensor, segment: Segment, group: dict, out: Tensor) -> Tensor:
        """The matrices Newton–Schulz orthogonalizes (before DiagPre, for MuonEq), from ``M̃``
        of one segment's rows: ``M`` ``(k, m, n)`` in float32 at least (read only; ``out`` is
        scratch of its shape and dtype the method may write). ``segment`` holds these matrices'
        parameters, banked state (``segment.state``) and layout. Default: ``M̃`` itself."""
        return M

    def finish(self, O: Tensor, segment: Segment, group: dict) -> Tensor:
        """The directions of one segment's rows from their Newton–Schulz output ``O``
        ``(k, m, n)``, which it may overwrite (in the NS dtype where
        :attr:`finishes_in_ns_dtype`, else contiguous in float32 at least): what line 13
        applies. Default: ``O`` itself."""
        return O

    # ----------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        """One step: Algorithm 1 for every matrix group (:func:`muoneq.functional.step_stacks`,
        or its distributed form), AdamW for the others; ``closure`` is evaluated first, with
        gradients enabled, and its loss returned."""
        loss = self._evaluate(closure)
        steps = self._planned()
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                prepared = self._group_to_step(group)
                if prepared is not None:
                    group, params = prepared
                    beta1, beta2 = group["adamw_betas"]
                    adamw_update(params, [p.grad for p in params],
                                 [self.state[p] for p in params], lr=group["lr"], beta1=beta1,
                                 beta2=beta2, eps=group["adamw_eps"],
                                 weight_decay=group["weight_decay"],
                                 capturable=group.get("capturable", False))
                continue
            planned = steps[index]
            if not planned.params or planned.params[0].grad is None:  # no gradient at all
                continue
            capturable = group.get("capturable", False)
            settings = planned.settings
            arguments = dict(
                rule=self, group=group, lr=group["lr"] if capturable else scalar(group["lr"]),
                weight_decay=group["weight_decay"], beta=group["momentum"],
                nesterov=group["nesterov"], mode=settings.mode, eps=group.get("eps", 0.0),
                ns=settings.ns, decay=planned.decay, compiled=self._compiled)
            grads = [local(p.grad) for p in planned.params]
            if planned.exchange is None:
                step_stacks(planned.chunks, planned.weights, grads, planned.momenta, **arguments)
            else:
                distributed.step_exchanged(planned, grads, **arguments)
        return loss

    def _planned(self) -> dict[int, GroupStep]:
        """Check the plans (Python only: no tensor is touched unless something changed) and
        return each matrix group's step as planned (the groups with a gradient), planned again
        when a group, its state, which of its matrices have a gradient, or a setting they
        depend on changed."""
        plans = self._plans
        if len(plans) != len(self.param_groups):
            plans = self._plans = [None] * len(self.param_groups)
        wanted = []
        for index, group in enumerate(self.param_groups):
            if not group["use_muon"]:
                continue
            plan = plans[index]
            if plan is None or not plan.matches(group["params"], self.state):
                plan = plans[index] = self._plan_group(group)
                self._steps = None
            grads = [p.grad for p in plan.params]
            if any(g is not None and g.is_sparse for g in grads):
                raise self._sparse_error()
            # a group none of whose matrices has a gradient is planned whole (its buffers are
            # what ``workspace_bytes`` reports before the first step) and not stepped
            present = tuple(g is not None for g in grads)
            wanted.append((index, self._stack_settings(index, group, plan),
                           present if any(present) else (True,) * len(present)))
        key = (tuple(wanted), planning.STACK_ELEMENTS, self.workspace_limit)
        if self._steps is None or self._steps[0] != key:
            self._steps = (key, self._plan_steps(wanted))
        return self._steps[1]

    def _stack_settings(self, index: int, group: dict, plan: GroupPlan) -> StackSettings:
        """What a group's chunks depend on (:class:`~muoneq.optim.plan.StackSettings`): made
        again only when the group's plan, ``ns_backend``, ``batching`` or one of
        :data:`PLANNED_KEYS` is not the object it was at the last step (a value that can change
        in place, such as a list, at every step); its values are then checked as the
        constructor checks them, with the same one-line errors."""
        given = (plan, self.ns_backend, self.batching,
                 *map(group.get, PLANNED_KEYS, PLANNED_KEYS.values()))
        cached = self._settings.get(index)
        if cached is not None and all(map(operator.is_, cached[0], given)):
            return cached[1]
        values = dict(zip(PLANNED_KEYS, given[3:], strict=True))
        self._check_values(group, values)
        device = plan.params[0].device
        settings = StackSettings(values["mode"], values["nesterov"],
                                 ns_settings(values["ns_steps"], values["ns_coefficients"],
                                             values["ns_dtype"], values["ns_algorithm"],
                                             self.ns_backend, device=device),
                                 values["lr_adjust"], per_matrix=not self._stacked(device),
                                 wire=self._wire(plan))
        if all(_immutable(value) for value in given[2:]):
            self._settings[index] = (given, settings)
        else:
            self._settings.pop(index, None)
        return settings

    def _wire(self, plan: GroupPlan) -> torch.dtype | None:
        """The dtype directions travel in between ranks: the NS dtype (``None``) where
        :meth:`finish` returns it, else float32 at least, and at least every banked state's
        dtype (the state travels with them, exactly)."""
        if self.finishes_in_ns_dtype and not self.banked_state:
            return None
        return promoted(plan.params[0].dtype, torch.float32,
                        *{t.dtype for bank in plan.banks for t in bank.state.values()})

    def _plan_steps(self, wanted: list[tuple[int, StackSettings, tuple[bool, ...]]]
                    ) -> dict[int, GroupStep]:
        """Plan the chunks of every group in ``wanted`` and carve their buffers from one
        workspace within ``workspace_limit`` (:func:`~muoneq.optim.plan.plan_workspace`); a
        group split between DDP ranks or sharded by FSDP2 gets its exchange
        (:mod:`muoneq.optim.distributed`), whose chunks are carved from the same workspace."""
        exchanges = {index: self._exchange_of(self._plans[index], present)
                     for index, _, present in wanted}
        planned = {index: (self._plans[index], settings, present,
                           distributed.computed_banks(self._plans[index], exchanges[index]))
                   for index, settings, present in wanted}
        limit = self.workspace_limit
        if limit == "auto":
            limit = AUTO_WORKSPACE_OVER_MUON * max(
                (muon_step_bytes(block, p.dtype, self.param_groups[index]["nesterov"])
                 for index, (plan, *_) in planned.items()
                 for p, layout in zip(plan.params, plan.layouts, strict=True)
                 for block in layout.blocks), default=0)
        self._workspace, chunks = plan_workspace(planned, limit, self)
        steps = {}
        for index, settings, present in wanted:
            plan, exchange = self._plans[index], exchanges[index]
            exchanged = distributed.plan_exchange(exchange, chunks[index], settings,
                                                  self._workspace, self)
            for part in (chunks[index], exchanged):
                carve(part, settings, self._workspace)
            distributed.carve_exchange(exchange, chunks[index], exchanged, settings, self)
            params = [p for p, ok in zip(plan.params, present, strict=True) if ok]
            momenta = [m for m, ok in zip(plan.momenta, present, strict=True) if ok]
            steps[index] = GroupStep(settings, params, [local(p) for p in params], momenta,
                                     chunks[index], exchanged, exchange, plan.decay)
            if self.compile:
                for chunk in chunks[index] + exchanged:
                    for stage, fn in (("prologue", prologue), ("update", add_directions)):
                        if (stage, chunk.shape) not in self._compiled:
                            self._compiled[stage, chunk.shape] = compiled_copy(fn, chunk.shape)
        return steps

    def _exchange_of(self, plan: GroupPlan, present: tuple[bool, ...]):
        """How a group's matrices are shared out between processes: row-sharded ``DTensor``
        parameters (FSDP2) gather whole matrices on their owners; replicated ones under DDP are
        split between the ranks of :meth:`_split_group`; ``None``: this process computes every
        matrix."""
        if plan.sharded:
            return distributed.Sharded.of(plan, present, self)
        group = self._split_group()
        if group is None:
            return None
        if not self._checked_same_gradients:
            distributed.check_same_gradients(
                [local(p.grad) for p, ok in zip(plan.params, present, strict=True) if ok],
                group)
            self._checked_same_gradients = True
        return distributed.Split(group)

    @property
    def planned_backends(self) -> dict[tuple[int, int], str]:
        """The Newton–Schulz backend of each shape of matrices, as planned at the last step
        (``ns_backend="auto"`` chooses per shape)."""
        steps = {} if self._steps is None else self._steps[1]
        return {chunk.shape: chunk.iteration.name for step in steps.values()
                for chunk in step.exchanged or step.chunks}

    def _stacked(self, device: torch.device) -> bool:
        """Whether the group's matrices are stacked (``batching``; ``"auto"``: off the CPU)."""
        return self.batching == "stacked" or (self.batching == "auto" and device.type != "cpu")

    def _split_group(self):
        """The process group to split replicated matrices over, ``None`` to compute them
        here."""
        if self.distributed is False:
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


def _immutable(value) -> bool:
    """Whether ``value`` cannot change in place: a string, number, ``None``, dtype, or a tuple
    of these."""
    if type(value) is tuple:
        return all(_immutable(v) for v in value)
    return type(value) in (str, int, float, bool, type(None), torch.dtype)
