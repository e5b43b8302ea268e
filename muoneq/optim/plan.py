"""The plan of a matrix group: momentum banks, then chunks of same-shape matrices with every
buffer they need, made once and reused by every step.

**Banks.** At construction (and again after ``add_param_group``, ``load_state_dict``, a copy, a
reset of the state, or a parameter given new storage) a matrix group's parameters are grouped
into :class:`Bank`\\ s by stored layout, dtype and device; a bank's momentum is one
``(k, *stored)`` tensor whose rows are the parameters' ``momentum_buffer`` (views: the state
dict keeps its keys and values); a method's own per-matrix state is banked alike
(:attr:`~muoneq.optim.hybrid.HybridOrthogonalOptimizer.banked_state`). A row-sharded
``DTensor`` parameter (FSDP2) banks its local shard, its state a ``DTensor`` over that row; a
replicated one (tensor parallelism's) its copy, its state replicated alike.

**Chunks.** :func:`plan_stacks` buckets the banks' blocks by matrix shape into :class:`Chunk`\\ s
of at most ``stack_elements`` elements (one matrix each with ``batching="per_matrix"``), fewer
where the group's ``workspace_limit`` asks (:func:`plan_workspace`), and :func:`carve` gives
every chunk its buffers — views of one workspace the chunks share, as they run one after
another — and the lists its update reads. A chunk's segments are the runs of its rows that come
from one bank: :func:`muoneq.functional.step_stacks` stages ``M̃`` into the stack from them
(formed in the stack itself for a plain float32 bank), and a method's ``prepare`` and
``finish`` see one segment's rows and banked state at a time.

A stored layout other than ``(out, in·…)`` (transposed, expert banks, fused blocks) is staged
into the stack with a copy of ``M̃`` in matrix orientation, and its directions are written back
in the stored layout before the update, so that every block gets, bit for bit, the update the
same weights get as a separate ``nn.Linear``.
"""

from __future__ import annotations

import functools
import math
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import torch
from torch import Tensor

from muoneq.functional import (
    DiagPreBuffers,
    Rule,
    diag_pre_buffers,
    diag_pre_requests,
    is_dtensor,
    local,
    lr_scale,
)
from muoneq.layout import MatrixLayout
from muoneq.newton_schulz import (
    AGREEMENT,
    Iteration,
    NSSettings,
    Request,
    StackIteration,
    Workspace,
    auto_candidates,
    fastest_iteration,
    iteration_for,
)

#: Largest stack (elements) of same-shape matrices orthogonalized in one batched call.
STACK_ELEMENTS = 1 << 26


@functools.cache
def promoted(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype that holds every one of ``dtypes`` exactly (``torch.promote_types`` folded;
    cached: a step asks without dispatching anything)."""
    return functools.reduce(torch.promote_types, dtypes)


# ----------------------------------------------------------------------------- banks
@dataclass(frozen=True)
class Banked:
    """A method's own state kept per matrix in banks like the momentum: its shape for a
    :class:`~muoneq.layout.MatrixLayout`, its dtype for the parameters' (``None``: theirs), and
    its value before the first step, ``initial(shape, dtype=…, device=…)`` (``torch.zeros``,
    ``torch.ones``, …)."""

    shape: Callable[[MatrixLayout], tuple[int, ...]]
    dtype: Callable[[torch.dtype], torch.dtype] | None = None
    initial: Callable[..., Tensor] = torch.zeros


#: State banked per matrix, by key (the momentum: the stored parameter's shape and dtype).
StateShapes = dict[str, Banked]


@dataclass(eq=False)
class Bank:
    """Parameters of one group that share a stored layout, dtype and device, with their
    momentum as one ``(k, *stored)`` tensor (a sharded parameter's: ``(k, local rows, …)``):
    row ``j`` is parameter ``j``'s ``momentum_buffer``; ``state`` likewise holds a method's own
    per-matrix state (a sharded parameter's: this rank's rows of it), ``shapes`` the whole
    shape of one matrix's state by key. ``gather`` (``(k, *stored)``, the parameters' dtype)
    holds ``M̃`` of a bank that is not formed in its stacks, and its directions in the stored
    layout."""

    params: list[Tensor]
    layout: MatrixLayout
    momentum: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    gather: Tensor | None = None
    #: ``M̃`` arrives whole from the parameters' shards (FSDP2; :mod:`muoneq.optim.distributed`):
    #: the directions stay in ``gather``, for the exchange back; ``state`` is whole, and so is
    #: ``gradient`` (``(k, *stored)``, for a method that reads whole gradients)
    assembled: bool = False
    gradient: Tensor | None = None
    #: DiagPre's dtype: float32 at least (bf16 sums of squares lose too much)
    accumulate: torch.dtype = field(init=False)
    #: plain layout in the accumulation dtype: ``M̃`` is formed in the stack itself
    in_place: bool = field(init=False)

    def __post_init__(self) -> None:
        self.accumulate = torch.promote_types(self.momentum.dtype, torch.float32)
        self.in_place = (self.layout.plain and self.momentum.dtype == self.accumulate
                         and not self.assembled)


def bank_state(params: Sequence[Tensor], layouts: Sequence[MatrixLayout], state: dict,
               shapes: StateShapes | None = None) -> list[Bank]:
    """Bank the momentum (and the state of ``shapes``) of a group's parameters by (layout,
    dtype, device, local shape): state already there is copied into its bank, missing state
    starts at its ``initial`` value (the momentum at zero), and the state then holds the bank's
    views. A ``DTensor`` parameter's state is a ``DTensor`` too, as distributed checkpoints
    need: the momentum sharded as the parameter, a method's own state by the rows of its own
    first dimension (``Shard(0)``, :func:`shard_rows`; replicated when it has none)."""
    shapes = {"momentum_buffer": Banked(lambda layout: layout.stored), **(shapes or {})}
    keyed: dict[tuple, list[int]] = {}
    for i, (p, layout) in enumerate(zip(params, layouts, strict=True)):
        keyed.setdefault((layout, p.dtype, p.device, tuple(local(p).shape)), []).append(i)
    banks = []
    for (layout, dtype, device, _), members in keyed.items():
        tensors, whole = {}, {}
        for key, banked in shapes.items():
            whole[key] = shape = banked.shape(layout)
            rows = OwnRows.of(params[members[0]], shape)
            like = {"device": device, "dtype": dtype if banked.dtype is None else
                    banked.dtype(dtype)}
            tensors[key] = torch.zeros((len(members), *rows.local_shape), **like)
            for i, view in zip(members, tensors[key].unbind(0), strict=True):
                p, old = params[i], state[params[i]].get(key)
                if old is not None:  # a sharded state's rows, or a whole state's (loaded)
                    old = local(old)
                    view.copy_(rows.of_whole(old) if tuple(old.shape) == tuple(shape) else old)
                elif key != "momentum_buffer":
                    view.copy_(rows.of_whole(banked.initial(shape, **like)))
                state[p][key] = rows.state(p, view)
        momentum = tensors.pop("momentum_buffer")
        del whole["momentum_buffer"]
        banks.append(Bank([params[i] for i in members], layout, momentum, tensors, whole))
    return banks


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's rows under ``Shard(0)`` (``torch.chunk``'s rule)."""
    size = -(-rows // world)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(world)]


def row_shard_dim(p: Tensor) -> int | None:
    """The mesh dimension along which ``p`` is sharded by rows, ``None`` if it is not.

    Plain tensors and fully replicated ``DTensor``\\ s give ``None``; ``Shard(0)`` on one mesh
    dimension with ``Replicate`` on the others (FSDP2, HSDP) gives that dimension; any other
    layout (column or tensor-parallel shards) is rejected with an error naming it.
    """
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor import Replicate, Shard

    placements = p.placements
    sharded = [d for d, pl in enumerate(placements) if not isinstance(pl, Replicate)]
    if not sharded:
        return None
    if len(sharded) == 1 and placements[sharded[0]] == Shard(0):
        return sharded[0]
    raise NotImplementedError(
        f"a DTensor parameter of shape {tuple(p.shape)} has placements {placements}; "
        "orthogonalized updates support replicated tensors and row shards (Shard(0) on one "
        "mesh dimension, as FSDP2's fully_shard makes them), not column or tensor-parallel "
        "shards"
    )


@dataclass(frozen=True)
class OwnRows:
    """The rows ``start : start + length`` of a ``shape`` tensor this rank holds for a
    parameter (all of them unless the parameter is a row-sharded ``DTensor``, whose sharded
    mesh dimension is ``sharded_dim``: :func:`row_shard_dim`)."""

    shape: tuple[int, ...]
    start: int
    length: int
    sharded_dim: int | None

    @classmethod
    def of(cls, p: Tensor, shape: Sequence[int]) -> OwnRows:
        """The rows of a ``shape`` tensor (a state of ``p``, or ``p`` itself) this rank holds:
        under ``Shard(0)``, its share of the first dimension (a 0-d state: none)."""
        shape = tuple(shape)
        dim = row_shard_dim(p)
        if dim is None:
            return cls(shape, 0, shape[0] if shape else 0, None)
        mesh = p.device_mesh
        start, length = (shard_rows(shape[0], mesh.size(dim))[mesh.get_local_rank(dim)]
                         if shape else (0, 0))
        return cls(shape, start, length, dim)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.length, *self.shape[1:]) if self.shape else ()

    def of_whole(self, whole: Tensor) -> Tensor:
        return whole[self.start : self.start + self.length] if self.shape else whole

    def state(self, p: Tensor, view: Tensor) -> Tensor:
        """``view`` (this rank's rows) as the state of ``p``: a ``DTensor`` over ``p``'s mesh
        when ``p`` is one, placed as ``p`` is (replicated for a 0-d state of a row-sharded
        ``p``), else ``view`` itself."""
        if not is_dtensor(p):
            return view
        from torch.distributed.tensor import DTensor, Replicate

        placements = list(p.placements)
        if self.sharded_dim is not None and not self.shape:
            placements[self.sharded_dim] = Replicate()
        return DTensor.from_local(view, p.device_mesh, placements, run_check=False,
                                  shape=torch.Size(self.shape),
                                  stride=torch.empty(self.shape, device="meta").stride())


@dataclass(eq=False)
class GroupPlan:
    """One matrix group as planned: its parameters, their state and momentum as they were when
    the plan was made (for :meth:`matches`), their layouts and the banks."""

    params: list[Tensor]
    layouts: list[MatrixLayout]
    states: list[dict]
    pointers: list[int]
    banks: list[Bank]
    #: the banked state of the parameters as planned: each key :func:`bank_state` banked → its
    #: tensor in each parameter's state
    banked: dict[str, list[Tensor]]
    #: this rank's momentum of each parameter (a row of its bank)
    momenta: list[Tensor]
    #: line 13's ``1 − η·λ`` of a step with tensor hyper-parameters (``capturable``)
    decay: Tensor | None = None

    @classmethod
    def of(cls, params: Sequence[Tensor], layouts: Sequence[MatrixLayout], banks: list[Bank],
           state: dict) -> GroupPlan:
        keys = ["momentum_buffer", *(banks[0].state if banks else ())]
        rows = {id(p): row for b in banks for p, row in zip(b.params, b.momentum.unbind(0),
                                                            strict=True)}
        device = banks[0].momentum.device if banks else None
        return cls(list(params), list(layouts), [state[p] for p in params],
                   [local(p).data_ptr() for p in params], banks,
                   {key: [state[p].get(key) for p in params] for key in keys},
                   [rows[id(p)] for p in params],
                   torch.empty((), dtype=torch.float32, device=device) if banks else None)

    @property
    def sharded(self) -> bool:
        """The parameters are row-sharded ``DTensor``\\ s (FSDP2; a replicated one is not:
        :func:`row_shard_dim`)."""
        return any(row_shard_dim(p) is not None for p in self.params)

    def matches(self, params: Sequence[Tensor], state: dict) -> bool:
        """The group still holds these parameters, in place (same storage), with the state and
        momentum the plan made. Python only: no tensor operation, no device sync (and every
        comparison in C where it can be: the step asks this of every group)."""
        same = operator.is_
        if not (len(params) == len(self.params) and all(map(same, params, self.params))
                and all(map(same, map(state.get, params), self.states))):
            return False
        for key, tensors in self.banked.items():
            if not all(map(same, map(dict.get, self.states, repeat(key)), tensors)):
                return False
        return list(map(Tensor.data_ptr, map(local, params))) == self.pointers


# ----------------------------------------------------------------------------- chunks
@dataclass(frozen=True)
class StackSettings:
    """What a group's chunks and their buffers depend on (a change plans them again)."""

    mode: str
    nesterov: bool
    ns: NSSettings
    lr_adjust: str
    #: one matrix per chunk, in torch.optim.Muon's operations (``batching="per_matrix"``)
    per_matrix: bool = False
    #: the dtype directions (and a method's state) travel in between ranks (``None``: the NS
    #: dtype)
    wire: torch.dtype | None = None


@dataclass(eq=False)
class Segment:
    """Parameters ``lo:hi`` of a bank (split ``split`` of their blocks) inside a chunk: what a
    method's ``prepare`` and ``finish`` see besides the rows — the parameters, their momentum and
    banked ``state`` (views, by key), and the bank's layout.

    ``stack``: the segment's rows of the chunk's stack, shaped like the bank's oriented blocks;
    ``source``: what is copied there before the prologue (the bank's ``M̃`` or momentum), or
    ``None`` when ``M̃`` is formed in the stack itself (``gather``: those rows shaped
    ``(k, *stored)``) or read where it is.

    ``scratch``: the segment's rows of the buffers the method asked for
    (:meth:`~muoneq.functional.Rule.requests`); ``gradient``: its rows of the chunk's
    gradients ``(k, m, n)`` (for a method that reads them), where the step stacks the
    parameters' gradients (``gradient_stack``: in the stored layout), copied
    (``gradient_copy``: ``(target, source)``) where they were staged or arrived in another
    layout."""

    bank: Bank
    split: int
    lo: int
    hi: int
    params: list[Tensor]
    momentum: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    #: the segment's matrices in the chunk
    rows: slice | None = None
    stack: Tensor | None = None
    source: Tensor | None = None
    gather: Tensor | None = None
    scratch: dict[str, Tensor] = field(default_factory=dict)
    gradient: Tensor | None = None
    gradient_stack: Tensor | None = None
    gradient_copy: tuple[Tensor, Tensor] | None = None

    @classmethod
    def of(cls, bank: Bank, split: int, lo: int, hi: int) -> Segment:
        """Parameters ``lo:hi`` of ``bank`` (split ``split`` of their blocks), with their rows
        of the bank's momentum and state."""
        return cls(bank, split, lo, hi, bank.params[lo:hi], bank.momentum[lo:hi],
                   {key: t[lo:hi] for key, t in bank.state.items()})

    @property
    def count(self) -> int:
        """Matrices of the segment (parameters × experts)."""
        return (self.hi - self.lo) * self.bank.layout.count

    @property
    def layout(self) -> MatrixLayout:
        return self.bank.layout


@dataclass(eq=False)
class Chunk:
    """Same-shape matrices stepped together: their segments, buffers and update lists.

    Buffers (views of the shared workspace, reserved in ``requests``): ``stack`` (``M̃``, then
    scratch; the accumulation dtype), ``ns_input`` (``X₀`` in the NS dtype; ``stack`` itself when
    the dtypes agree), ``ns_buffers`` (the iteration's), ``diag`` (DiagPre's), ``step``
    (``−a·η`` as a tensor), and the method's (``rule_buffers``, by the name it gave; the
    gradients it reads, ``gradient``, and their stored-layout staging, ``gradient_stored``),
    which its segments see by rows. ``source`` is where the prologue reads ``M̃`` (the stack,
    or a lone plain bank's momentum without Nesterov).

    The update reads the directions from ``final`` (the buffer of the last iterate, when the
    iteration has one) where ``final_readable`` (the parameters' dtype), else from ``stack``:
    ``targets`` and ``sources[i]`` (``i`` = 0: views of ``final``, 1: of ``stack``) are the lists
    of the foreach update; ``writebacks`` the ``(stored-layout block, (from final, from stack))``
    copies of staged banks' directions, and ``completes`` the ``(params, directions)`` of the
    banks whose directions are all in their stored layout after this chunk (their blocks have
    the chunk's shape, and so its ``a``). ``stages`` are the ``(params, gather, momentum)`` of
    the staged banks whose first blocks this chunk holds, where the step forms their ``M̃``
    (:func:`~muoneq.functional.stage_banks`). Both hold the runs of parameters with a gradient
    only.
    """

    shape: tuple[int, int]
    scale: float
    segments: list[Segment]
    iteration: Iteration
    requests: list[tuple] = field(default_factory=list)
    source: Tensor | None = None
    stack: Tensor | None = None
    ns_input: Tensor | None = None
    ns_buffers: dict[str, Tensor] = field(default_factory=dict)
    rule_buffers: dict[str, Tensor] = field(default_factory=dict)
    gradient: Tensor | None = None
    gradient_stored: Tensor | None = None
    diag: DiagPreBuffers | None = None
    final: Tensor | None = None
    final_readable: bool = False
    targets: list[Tensor] = field(default_factory=list)
    sources: tuple[list[Tensor], list[Tensor]] = field(default_factory=lambda: ([], []))
    writebacks: list[tuple[Tensor, tuple[Tensor | None, Tensor]]] = field(default_factory=list)
    completes: list[tuple[list[Tensor], list[Tensor]]] = field(default_factory=list)
    stages: list[tuple[list[Tensor], Tensor, Tensor]] = field(default_factory=list)
    step: Tensor | None = None

    @property
    def count(self) -> int:
        return sum(s.count for s in self.segments)


@dataclass(eq=False)
class GroupStep:
    """A matrix group's step as planned: what :meth:`HybridOrthogonalOptimizer.step
    <muoneq.optim.hybrid.HybridOrthogonalOptimizer.step>` hands
    :func:`muoneq.functional.step_stacks` (or its distributed form)."""

    settings: StackSettings
    #: the parameters with a gradient, the tensors this rank holds of them (:func:`local`:
    #: what line 13 updates) and its momentum of each, in the plan's order
    params: list[Tensor]
    weights: list[Tensor]
    momenta: list[Tensor]
    #: the chunks of the group's matrices (FSDP2: of the whole matrices this rank computes)
    chunks: list[Chunk]
    #: DDP: the parts of ``chunks`` this rank computes for every rank
    exchanged: list[Chunk]
    #: how the matrices are shared out between processes (:mod:`muoneq.optim.distributed`)
    exchange: object | None
    #: line 13's ``1 − η·λ`` of a step with tensor hyper-parameters (``capturable``)
    decay: Tensor | None


def compiled_copy(fn: Callable, shape: tuple[int, int]) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` on a copy of ``fn`` with a code
    object of its own: dynamo keeps at most ``recompile_limit`` (8) graphs per code object and,
    with ``fullgraph``, fails past them; each chunk shape (ResNet-18 has 10) compiles its own
    copy, named for its shape in traces."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{shape[0]}x{shape[1]}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return torch.compile(copy, fullgraph=True, dynamic=False)


def plan_stacks(plan: GroupPlan, settings: StackSettings, workspace: Workspace, rule: Rule, *,
                present: Sequence[bool] | None = None, chunk_bytes: int | None = None,
                banks: list[Bank] | None = None) -> list[Chunk]:
    """Bucket the blocks of a group's banks (``banks``, default the plan's) by matrix shape
    (and dtype, device) into chunks of at most :data:`STACK_ELEMENTS` elements (one matrix with
    ``per_matrix``) whose buffers (the method's, ``rule``'s, included) take at most
    ``chunk_bytes`` (at least one parameter each), with the parameters that have a gradient
    (``present``, in the plan's order; default all), and reserve their buffers in
    ``workspace``; :func:`carve` gives them out once every group is planned."""
    with_grad = {id(p) for p, ok in zip(plan.params, present or [True] * len(plan.params),
                                        strict=True) if ok}
    buckets: dict[tuple, list[tuple[Bank, int]]] = {}
    for bank in plan.banks if banks is None else banks:
        for split, rows in enumerate(bank.layout.rows):
            key = ((rows, bank.layout.matrix[1]), bank.momentum.dtype, bank.momentum.device)
            buckets.setdefault(key, []).append((bank, split))
    chunks = []
    for (shape, _, _), members in buckets.items():
        per_stack = 1 if settings.per_matrix else max(1, STACK_ELEMENTS // math.prod(shape))
        if chunk_bytes is not None:
            one = _requests(1, shape, members[0][0].momentum.dtype, settings, rule)
            matrix = sum(math.prod(size) * dtype.itemsize for name, size, dtype in one
                         if name != "step")
            per_stack = min(per_stack, max(1, chunk_bytes // matrix))
        current: list[Segment] = []
        filled = 0
        for bank, split in members:
            count = bank.layout.count
            for lo, hi in runs_of([id(p) in with_grad for p in bank.params]):
                while lo < hi:
                    if current and filled + count > per_stack:
                        chunks.append(chunk_of(current, settings, workspace, rule))
                        current, filled = [], 0
                    end = min(hi, lo + max(1, (per_stack - filled) // count))
                    current.append(Segment.of(bank, split, lo, end))
                    filled += (end - lo) * count
                    lo = end
        if current:
            chunks.append(chunk_of(current, settings, workspace, rule))
    return chunks


def runs_of(flags: list[bool]) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each run of true flags."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def chunk_of(segments: list[Segment], settings: StackSettings, workspace: Workspace,
             rule: Rule) -> Chunk:
    """A chunk of ``segments`` (same-shape blocks), its buffers reserved in ``workspace``."""
    bank = segments[0].bank
    shape = (bank.layout.rows[segments[0].split], bank.layout.matrix[1])
    chunk = Chunk(shape, lr_scale(shape, settings.lr_adjust), segments,
                  iteration_for(settings.ns, shape, per_matrix=settings.per_matrix))
    count = sum(s.count for s in segments)
    requests = _requests(count, shape, bank.momentum.dtype, settings, rule, chunk.iteration)
    staged = sum((s.hi - s.lo) * math.prod(s.layout.stored) for s in segments
                 if not (s.layout.plain or s.bank.assembled))
    if rule.reads_gradient and staged:  # stacked in the stored layout first
        requests.append(("gradient_stored", (staged,), bank.momentum.dtype))
    chunk.requests = [(*r, bank.momentum.device) for r in requests]
    for request in chunk.requests:
        workspace.reserve(*request)
    return chunk


def _requests(count: int, shape: tuple[int, int], dtype: torch.dtype, settings: StackSettings,
              rule: Rule, iteration: Iteration | None = None) -> list[Request]:
    """The buffers of a chunk of ``count`` matrices of ``shape`` whose parameters have
    ``dtype`` (:class:`Chunk`): name, shape and dtype (the method's named ``("rule", name)``)."""
    ns = settings.ns.dtype
    accumulate = torch.promote_types(dtype, torch.float32)
    iteration = iteration or iteration_for(settings.ns, shape, per_matrix=settings.per_matrix)
    requests = [("stack", (count, *shape), accumulate)]
    if ns != accumulate:
        requests.append(("ns_input", (count, *shape), ns))
    requests += iteration.requests(count, shape, ns)
    requests += diag_pre_requests(count, shape, settings.mode, accumulate, ns)
    requests.append(("step", (1,), accumulate))
    if rule.reads_gradient:
        requests.append(("gradient", (count, *shape), accumulate))
    requests += [(("rule", name), size, t) for name, size, t in rule.requests(count, shape, dtype)]
    return requests


def carve(chunks: list[Chunk], settings: StackSettings, workspace: Workspace) -> None:
    """Give each chunk its buffers (views of ``workspace``, all reserved before: one buffer per
    name, shared by the chunks, which run one after another), its segments' rows, its update
    lists and, for ``ns_backend="auto"`` on a GPU, its iteration."""
    steps = settings.ns.schedule.steps
    for chunk in chunks:
        taken = {name: workspace.take(name, *rest) for name, *rest in chunk.requests}
        chunk.stack = taken["stack"]
        chunk.ns_input = taken.get("ns_input", chunk.stack)
        chunk.ns_buffers = {name: taken[name] for name, *_ in
                            chunk.iteration.requests(chunk.count, chunk.shape, settings.ns.dtype)}
        chunk.diag = diag_pre_buffers(taken, settings.mode, chunk.stack)
        chunk.step = taken["step"].view(())
        chunk.rule_buffers = {name[1]: t for name, t in taken.items() if isinstance(name, tuple)}
        chunk.gradient = taken.get("gradient")
        chunk.gradient_stored = taken.get("gradient_stored")
        if settings.ns.backend == "auto":
            chunk.iteration = _fastest(chunk, settings)
        if isinstance(chunk.iteration, StackIteration):  # the last iterate's buffer is known
            chunk.final = (chunk.ns_input, chunk.ns_buffers["ns_other"])[steps % 2]
            chunk.final_readable = chunk.final.dtype == chunk.segments[0].momentum.dtype
        _carve_segments(chunk, settings)
    _stage_and_complete_banks(chunks)


def _fastest(chunk: Chunk, settings: StackSettings) -> Iteration:
    """``ns_backend="auto"``: on a GPU with Triton, the faster of torch and Triton on this
    chunk's buffers (one timing, at planning) among those that agree; torch elsewhere, and
    where the FLOP rule chose the Gram order (which runs on torch's products)."""
    import importlib.util

    X = chunk.ns_input
    if (not isinstance(chunk.iteration, StackIteration) or X.device.type != "cuda"
            or X.dtype not in AGREEMENT or X.dtype == torch.float64
            or importlib.util.find_spec("triton") is None or settings.per_matrix):
        return chunk.iteration
    candidates = auto_candidates()
    name = fastest_iteration(candidates, X, settings.ns.schedule.coefficients, chunk.ns_buffers)
    return candidates[name]


def _carve_segments(chunk: Chunk, settings: StackSettings) -> None:
    """Where each segment's ``M̃`` comes from and where its directions go (class docstrings)."""
    buffers = (chunk.final if chunk.final_readable else None, chunk.stack)
    offset, stored = 0, 0
    for segment in chunk.segments:
        bank, layout = segment.bank, segment.bank.layout
        rows = segment.rows = slice(offset, offset + segment.count)
        oriented = layout.stacked_blocks(segment.momentum)[segment.split]
        if bank.gather is None and not bank.in_place:
            bank.gather = torch.empty((len(bank.params), *layout.stored),
                                      dtype=bank.momentum.dtype, device=bank.momentum.device)
        segment.stack = chunk.stack[rows].view(oriented.shape)
        if bank.in_place:
            segment.gather = chunk.stack[rows].view(segment.momentum.shape)
            segment.source = None if settings.nesterov else oriented
        else:
            staged = layout.stacked_blocks(bank.gather[segment.lo : segment.hi])[segment.split]
            segment.source = staged if settings.nesterov or bank.assembled else oriented
        segment.scratch = {name: t[rows] if t.ndim else t
                           for name, t in chunk.rule_buffers.items()}
        if chunk.gradient is not None:
            stored = _carve_gradient(chunk, segment, stored)
        _carve_update(chunk, segment, offset, buffers)
        offset += segment.count
    # a lone plain segment without Nesterov is read where it is: M̃ is the momentum itself
    only = chunk.segments[0]
    if len(chunk.segments) == 1 and only.bank.in_place and not settings.nesterov:
        chunk.source, only.source = only.momentum.view(chunk.stack.shape), None
    else:
        chunk.source = chunk.stack


def _carve_gradient(chunk: Chunk, segment: Segment, stored: int) -> int:
    """Where a segment's gradients are stacked and copied (:class:`Segment`); ``stored``: the
    elements of the chunk's stored-layout staging taken so far (returned updated)."""
    layout, lo, hi = segment.layout, segment.lo, segment.hi
    segment.gradient = chunk.gradient[segment.rows]
    if layout.plain and not segment.bank.assembled:
        segment.gradient_stack = segment.gradient.view(hi - lo, *layout.stored)
        return stored
    if segment.bank.assembled:
        source = segment.bank.gradient[lo:hi]
    else:
        size = (hi - lo) * math.prod(layout.stored)
        source = segment.gradient_stack = chunk.gradient_stored[stored : stored + size].view(
            hi - lo, *layout.stored)
        stored += size
    oriented = layout.stacked_blocks(source)[segment.split]
    segment.gradient_copy = (segment.gradient.view(oriented.shape), oriented)
    return stored


def _carve_update(chunk: Chunk, segment: Segment, offset: int,
                  buffers: tuple[Tensor | None, Tensor]) -> None:
    """The update lists of a segment's directions (``buffers``: the last iterate's, readable in
    the parameters' dtype, and the stack): its parameters for a plain layout, the copies back
    to a staged bank's stored layout for the others."""
    bank, layout, rows = segment.bank, segment.bank.layout, segment.rows
    if layout.plain and not bank.assembled:
        chunk.targets += [local(p) for p in segment.params]
        for out, buffer in zip(chunk.sources, buffers, strict=True):
            if buffer is not None:
                out += [d.view(p.shape) for d, p in zip(buffer[rows], segment.params,
                                                        strict=True)]
    elif layout.uniform:  # back to the stored layout; one update per bank, at its end
        back = layout.stacked_blocks(bank.gather[segment.lo : segment.hi])[segment.split]
        chunk.writebacks.append((back, tuple(
            None if b is None else b[rows].view(back.shape) for b in buffers)))
    else:  # blocks of several shapes: each where it lies in its parameter (or whole bank)
        for j in range(segment.hi - segment.lo):
            whole = bank.gather[segment.lo + j] if bank.assembled else local(segment.params[j])
            pieces = list(layout.pieces(whole))[segment.split :: len(layout.rows)]
            for e, (_, piece) in enumerate(pieces):
                index = offset + j * layout.count + e
                views = tuple(None if b is None else b[index].view(piece.shape)
                              for b in buffers)
                if bank.assembled:
                    chunk.writebacks.append((piece, views))
                    continue
                chunk.targets.append(piece)
                for out, view in zip(chunk.sources, views, strict=True):
                    if view is not None:
                        out.append(view)


def _stage_and_complete_banks(chunks: list[Chunk]) -> None:
    """For each bank staged outside the stacks (not ``in_place``, not assembled), per run of
    the parameters ``chunks`` hold (those with a gradient): give the chunk that holds its first
    blocks the forming of ``M̃`` in ``gather``, and, for a uniform bank stored other than
    ``(out, in·…)``, the chunk that writes its last blocks back the update: the parameters, their
    directions in the stored layout, and ``a`` (an assembled bank's directions stay in
    ``gather``: :mod:`muoneq.optim.distributed` sends them)."""
    held: dict[int, tuple[Bank, Chunk, Chunk, set[int]]] = {}
    for chunk in chunks:
        for segment in chunk.segments:
            bank = segment.bank
            if bank.in_place or bank.assembled:
                continue
            _, first, _, rows = held.get(id(bank), (bank, chunk, chunk, set()))
            rows.update(range(segment.lo, segment.hi))
            held[id(bank)] = (bank, first, chunk, rows)
    for bank, first, last, rows in held.values():
        complete = not bank.layout.plain and bank.layout.uniform
        for lo, hi in runs_of([i in rows for i in range(len(bank.params))]):
            params, gather = bank.params[lo:hi], bank.gather[lo:hi]
            first.stages.append((params, gather, bank.momentum[lo:hi]))
            if complete:  # its blocks have the chunk's shape, and so its ``a``
                last.completes.append(([local(p) for p in params], list(gather.unbind(0))))


def muon_step_bytes(shape: tuple[int, int], dtype: torch.dtype, nesterov: bool) -> int:
    """The memory ``torch.optim.Muon``'s step takes beyond its state for one m×n matrix of
    ``dtype`` (it steps one matrix at a time, so its peak is its largest matrix's): the Nesterov
    input ``M̃`` in the parameters' dtype, then in bf16 the iterate and the next one, the Gram
    matrix and its polynomial (``s × s``, ``s = min(m, n)``)."""
    m, n = shape
    small = min(m, n)
    return (dtype.itemsize * m * n if nesterov else 0) + 2 * (2 * m * n + 2 * small * small)


def plan_workspace(plans: dict[int, tuple[GroupPlan, StackSettings, Sequence[bool], list[Bank]]],
                   limit: int | None, rule: Rule) -> tuple[Workspace, dict[int, list[Chunk]]]:
    """The chunks of every planned group (index → its plan, settings, which parameters have a
    gradient, and the banks this process computes), their buffers (the method's, ``rule``'s,
    included) reserved in one workspace that the chunks share (each buffer as large as its
    largest chunk's) and that holds at most ``limit`` bytes where chunks of one parameter
    allow: the bytes a chunk may take are lowered until the workspace fits."""
    chunk_bytes = limit
    while True:
        workspace = Workspace()
        stacks = {index: plan_stacks(plan, settings, workspace, rule, present=present,
                                     chunk_bytes=chunk_bytes, banks=banks)
                  for index, (plan, settings, present, banks) in plans.items()}
        planned = workspace.reserved_bytes
        several = any(c.count > c.segments[0].bank.layout.count or len(c.segments) > 1
                      for chunks in stacks.values() for c in chunks)
        if limit is None or planned <= limit or not several:
            return workspace, stacks
        chunk_bytes = min(chunk_bytes * limit // planned, chunk_bytes * 15 // 16)
