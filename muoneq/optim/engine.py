"""How a param group's matrices are stepped on one process: a plan built once, then, per stack of
same-shape matrices, prologue → Newton–Schulz → epilogue.

**The plan.** At construction (and again after ``add_param_group``, ``load_state_dict``, a copy,
or a reset of the state) each matrix group's parameters are grouped into :class:`Bank`\\ s by
stored layout, dtype and device; a bank's momentum is one ``(k, *stored)`` tensor whose rows are
the parameters' ``momentum_buffer`` (views: the state dict keeps its keys and values). Slots and
layouts are cached in a :class:`GroupPlan`. For the stacked path, :func:`plan_stacks` buckets
the banks' blocks by matrix shape into :class:`Chunk`\\ s of at most ``stack_elements`` elements
and carves every buffer a chunk needs, once, from a workspace the chunks share (they run one
after another): after the first step nothing is allocated.

**A stacked step** (:func:`step_stacks`), Algorithm 1 for every matrix of a group:

* line 13's decay ``X ← (1 − ηλ)·X``: one foreach call for the group;
* gather and lines 5–10: ``torch.stack(grads, out=…)`` (the one copy of the gradients),
  ``M ← lerp(M, G, 1−β)`` on the bank, ``M̃ = lerp(G, M, β)`` in place;
* the prologue (line 11 and NS's normalization): DiagPre's float32 sums of squares, the
  pseudo-inverse scales and the Frobenius normalization folded into one scale vector, applied
  and cast to the Newton–Schulz dtype in one write. For R (and C) the norm needs no pass over
  the matrix: ``‖D_r^{-1/2}M̃‖²_F = Σᵢ rᵢ/(rᵢ+ε)`` from the row sums ``rᵢ`` already there
  (Remark 3.3's zero rows add 0); RC and plain Muon compute it;
* Newton–Schulz (line 12) in the chunk's buffers: three batched products per step, tall
  matrices kept tall (:func:`muoneq.newton_schulz.iterate_stack`);
* the epilogue (line 13): ``X ← X − a·η·O``, one foreach call per chunk.

A stored layout other than ``(out, in·…)`` (transposed, expert banks, fused blocks) is staged
into the stack with a copy of ``M̃`` in matrix orientation, and its directions are written
back in the stored layout before the update, so that every block gets, bit for bit, the update
the same weights get as a separate ``nn.Linear``.

**The per-slot path** (:func:`directions`) serves the rest: one matrix at a time (the CPU
default; ``torch.optim.Muon``'s operations), methods with state of their own, and the
executors of :mod:`muoneq.optim.executors` (DDP, FSDP2), which hand it the matrices a rank owns.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from muoneq.functional import UpdateSettings, apply_update, lr_scale, momentum_input
from muoneq.layout import MatrixLayout
from muoneq.newton_schulz import (
    AGREEMENT,
    NORM_EPS,
    NSSchedule,
    Workspace,
    backend_iteration,
    fastest_iteration,
    gram_iterate,
    iterate_stack,
)


def is_dtensor(t) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (slow to
    import): no DTensor can exist before that module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


# ----------------------------------------------------------------------------- the per-slot path
@dataclass(eq=False)
class MatrixSlot:
    """One matrix parameter as this rank sees it.

    ``value`` and ``momentum`` are the local tensors (a ``DTensor``'s local shard, updated in
    place), in the stored layout; ``grad`` is read when asked (it changes from step to step);
    ``layout`` says which matrices the whole parameter holds.
    """

    param: Tensor
    value: Tensor
    momentum: Tensor
    layout: MatrixLayout

    @property
    def grad(self) -> Tensor:
        return local(self.param.grad)


@dataclass(frozen=True)
class DirectionRule:
    """How the directions of one param group are computed (lines 11–12).

    Either MuonEq's two validated stages, ``orthogonalize(precondition(M̃))`` (``precondition``
    ``None`` for plain NS), or a method's own ``direction(p, M̃, state)``. ``stacked``: same-shape
    matrices go through one batched call (stateless rules only), at most ``stack_elements``
    elements at a time (``None``: no limit).
    """

    orthogonalize: Callable[..., Tensor] | None = None
    precondition: Callable[..., Tensor] | None = None
    direction: Callable[[Tensor | None, Tensor, dict | None], Tensor] | None = None
    state: Callable[[Tensor], dict] | None = None
    stacked: bool = False
    stack_elements: int | None = None
    workspace: Workspace | None = None


@dataclass(frozen=True)
class GroupUpdate:
    """One param group's update this step, as the per-slot path and the executors need it: the
    settings of lines 5–13, the rule of its directions (lines 11–12), the dtype directions
    travel in, and the optimizer's scratch workspace. It holds no param group and no optimizer:
    it calls the functions of :mod:`muoneq.functional`."""

    settings: UpdateSettings
    rule: DirectionRule
    #: dtype of the directions on the wire (the Newton–Schulz dtype: nothing rounds twice)
    dtype: torch.dtype
    workspace: Workspace

    def m_tilde(self, slot: MatrixSlot) -> Tensor:
        """This rank's ``M̃`` of a slot (lines 6–10, stored layout), in scratch that is valid
        until the next call."""
        g = slot.grad
        return momentum_input(g, slot.momentum, self.settings,
                              out=self.workspace.take("m_tilde", g.shape, g.dtype, g.device))

    def whole_m_tilde(self, slot: MatrixSlot) -> Callable[[], Tensor]:
        """``M̃`` of a replicated slot (its local tensor is the whole parameter)."""
        return lambda: self.m_tilde(slot)

    def apply(self, slot: MatrixSlot, direction: Tensor, start: int = 0) -> None:
        """Line 13 on this rank's part of a slot (its rows from ``start``), ``direction`` in
        the stored layout."""
        apply_update(slot.value, direction, slot.layout, self.settings, start=start,
                     workspace=self.workspace)


@dataclass
class _Assembly:
    """The stored-layout direction of a parameter with several blocks, while blocks arrive."""

    buffer: Tensor
    missing: int


class _Assembler:
    """Hands ``sink`` each slot's whole direction in its stored layout: at once for a slot of
    one block, else assembled in an :class:`_Assembly` as its blocks arrive."""

    def __init__(self, sink: Callable[[object, Tensor], None]):
        self.sink = sink
        self.assembling: dict[int, _Assembly] = {}

    def deliver(self, slot, index: int, direction: Tensor) -> None:
        layout = slot.layout
        if len(layout.blocks) == 1:
            self.sink(slot, layout.stored_view(direction))
            return
        part = self.assembling.get(id(slot))
        if part is None:
            part = self.assembling[id(slot)] = _Assembly(
                torch.empty(layout.stored, dtype=direction.dtype, device=direction.device),
                len(layout.blocks))
        layout.put(part.buffer, index, direction)  # copied now: direction may be scratch
        part.missing -= 1
        if part.missing == 0:
            self.sink(slot, self.assembling.pop(id(slot)).buffer)


@dataclass
class _CutMomentum:
    """The blocks of the latest slot's ``M̃`` (scratch: only the latest slot's are valid)."""

    slot: object = None
    blocks: list | None = None

    def block(self, slot, index: int, thunk) -> Tensor:
        if self.slot is not slot:
            self.slot, self.blocks = slot, slot.layout.matrices(thunk())
        return self.blocks[index]


def _stacks(items: list, rule: DirectionRule):
    """The ``(shape, dtype, device, chunk)`` stacks of same-shape blocks of ``items``: every
    ``(slot, block index, M̃ thunk)`` of one shape, dtype and device, at most
    ``rule.stack_elements`` elements at a time."""
    buckets: dict[tuple, list] = {}
    for slot, thunk in items:
        for i, shape in enumerate(slot.layout.blocks):
            buckets.setdefault((shape, slot.grad.dtype, slot.grad.device), []).append(
                (slot, i, thunk))
    for (shape, dtype, device), bucket in buckets.items():
        per_stack = _per_stack(shape, rule.stack_elements, len(bucket))
        for start in range(0, len(bucket), per_stack):
            yield shape, dtype, device, bucket[start : start + per_stack]


def _per_stack(shape: tuple[int, int], stack_elements: int | None, count: int) -> int:
    """Matrices of ``shape`` per stack: at most ``stack_elements`` elements, at least one."""
    return count if stack_elements is None else max(1, stack_elements // math.prod(shape))


def directions(items: list, rule: DirectionRule, sink: Callable[[object, Tensor], None]) -> None:
    """Directions of ``(slot, whole stored M̃ thunk)`` items; ``sink(slot, direction)``
    receives each slot's whole direction in its stored layout.

    Each ``M̃`` is cut into the blocks of its slot's layout (:meth:`MatrixLayout.matrices`),
    each block gets its own direction, and the directions are written back in the stored
    layout. Per matrix (with the rule's workspace), or as stacks of same-shape blocks in one
    batched call (``rule.stacked``: one launch per Newton–Schulz product for the whole stack).
    """
    deliver = _Assembler(sink).deliver
    if not rule.stacked:
        ws = rule.workspace
        for slot, thunk in items:
            state = None if rule.state is None else rule.state(slot.param)
            for i, block in enumerate(slot.layout.matrices(thunk())):
                if rule.direction is not None:
                    deliver(slot, i, rule.direction(slot.param, block, state))
                    continue
                if rule.precondition is not None:
                    block = rule.precondition(block, workspace=ws)
                deliver(slot, i, rule.orthogonalize(block, workspace=ws))
        return
    cut = _CutMomentum()
    for shape, dtype, device, chunk in _stacks(items, rule):
        stack = torch.empty((len(chunk), *shape), dtype=dtype, device=device)
        for j, (slot, i, thunk) in enumerate(chunk):
            stack[j].copy_(cut.block(slot, i, thunk))
        cut.slot = cut.blocks = None
        if rule.direction is not None:
            found = rule.direction(None, stack, None)
        else:
            if rule.precondition is not None:
                stack = rule.precondition(stack, workspace=None)
            found = rule.orthogonalize(stack, workspace=None)
        del stack
        for j, (slot, i, _) in enumerate(chunk):
            deliver(slot, i, found[j])


# ----------------------------------------------------------------------------- the plan
@dataclass(eq=False)
class Bank:
    """Parameters of one group that share a stored layout, dtype and device, with their
    momentum as one ``(k, *stored)`` tensor: row ``j`` is parameter ``j``'s ``momentum_buffer``
    (a view); ``state`` likewise holds a method's own per-matrix state (NorMuon's second
    moments). ``gather`` (same shape, the parameters' dtype) holds the gradients and ``M̃`` of
    a bank that is not staged in place, and its directions before the update."""

    params: list[Tensor]
    layout: MatrixLayout
    momentum: Tensor
    state: dict[str, Tensor] = field(default_factory=dict)
    gather: Tensor | None = None
    #: DiagPre's dtype: float32 at least (bf16 sums of squares lose too much)
    accumulate: torch.dtype = field(init=False)
    #: plain layout in the accumulation dtype: ``M̃`` is formed in the stack itself
    in_place: bool = field(init=False)

    def __post_init__(self) -> None:
        self.accumulate = torch.promote_types(self.momentum.dtype, torch.float32)
        self.in_place = self.layout.plain and self.momentum.dtype == self.accumulate


@dataclass(eq=False)
class GroupPlan:
    """One matrix group as planned: its parameters, their state and momentum as they were when
    the plan was made, their layouts, cached slots (``None`` for a ``DTensor``, whose local
    shard is read each step) and the banks. :meth:`matches` says whether that still holds
    (else the optimizer plans the group again)."""

    params: list[Tensor]
    layouts: list[MatrixLayout]
    states: list[dict]
    momenta: list[Tensor]
    pointers: list[int | None]
    slots: list[MatrixSlot | None]
    banks: list[Bank]
    #: the banked state of each parameter (the keys :func:`bank_state` banked), as planned
    banked: list[dict[str, Tensor]] = field(default_factory=list)
    #: line 13's ``1 − η·λ`` of a stacked step with tensor hyper-parameters (``capturable``)
    decay: Tensor | None = None

    @classmethod
    def of(cls, params: Sequence[Tensor], layouts: Sequence[MatrixLayout], banks: list[Bank],
           state: dict) -> GroupPlan:
        plain = [not is_dtensor(p) for p in params]
        keys = ["momentum_buffer", *(banks[0].state if banks else ())]
        return cls(list(params), list(layouts), [state[p] for p in params],
                   [state[p]["momentum_buffer"] for p in params],
                   [p.data_ptr() if ok else None for p, ok in zip(params, plain, strict=True)],
                   [MatrixSlot(p, p, state[p]["momentum_buffer"], layout) if ok else None
                    for p, layout, ok in zip(params, layouts, plain, strict=True)], banks,
                   [{key: state[p].get(key) for key in keys} for p in params])

    @property
    def replicated(self) -> bool:
        """Every parameter is a plain tensor (no ``DTensor``): the banks hold them all."""
        return all(slot is not None for slot in self.slots)

    def matches(self, params: Sequence[Tensor], state: dict) -> bool:
        """The group still holds these parameters, in place (same storage), with the state and
        momentum the plan made. Python only: no tensor operation, no device sync."""
        if len(params) != len(self.params):
            return False
        for p, planned, st, banked, pointer in zip(params, self.params, self.states,
                                                    self.banked, self.pointers, strict=True):
            if (p is not planned or state.get(p) is not st
                    or any(st.get(key) is not t for key, t in banked.items())
                    or (pointer is not None and p.data_ptr() != pointer)):
                return False
        return True


@dataclass(frozen=True)
class Banked:
    """A method's own state kept per matrix in banks like the momentum: its shape for a
    :class:`~muoneq.layout.MatrixLayout`, and its dtype for the parameters' (``None``: theirs)."""

    shape: Callable[[MatrixLayout], tuple[int, ...]]
    dtype: Callable[[torch.dtype], torch.dtype] | None = None


#: State banked per matrix, by key (the momentum: the stored parameter's shape and dtype).
StateShapes = dict[str, Banked]


def bank_state(params: Sequence[Tensor], layouts: Sequence[MatrixLayout], state: dict,
               shapes: StateShapes | None = None) -> list[Bank]:
    """Bank the momentum (and the state of ``shapes``) of a group's plain-tensor parameters by
    (layout, dtype, device): state already there is copied into its bank, missing state starts
    at zero, and the state then holds the bank's views. ``DTensor`` parameters keep their own
    state."""
    shapes = {"momentum_buffer": Banked(lambda layout: layout.stored), **(shapes or {})}
    keyed: dict[tuple, list[int]] = {}
    for i, (p, layout) in enumerate(zip(params, layouts, strict=True)):
        if not is_dtensor(p):
            keyed.setdefault((layout, p.dtype, p.device), []).append(i)
    banks = []
    for (layout, dtype, device), members in keyed.items():
        tensors = {}
        for key, banked in shapes.items():
            tensors[key] = torch.zeros((len(members), *banked.shape(layout)), device=device,
                                       dtype=dtype if banked.dtype is None else banked.dtype(dtype))
            for i, view in zip(members, tensors[key].unbind(0), strict=True):
                old = state[params[i]].get(key)
                if old is not None:
                    view.copy_(old)
                state[params[i]][key] = view
        momentum = tensors.pop("momentum_buffer")
        banks.append(Bank([params[i] for i in members], layout, momentum, tensors))
    return banks


# ----------------------------------------------------------------------------- stacks
@dataclass(frozen=True)
class StackSettings:
    """What a group's stacks and their buffers depend on (a change plans them again)."""

    mode: str
    nesterov: bool
    dtype: torch.dtype  # of Newton–Schulz
    schedule: NSSchedule
    algorithm: str
    lr_adjust: str
    backend: str | Callable = "torch"  # ns_backend
    #: each chunk's prologue and update compiled (``compile=True``)
    compile: bool = False
    #: a method's map from a chunk's ``M̃`` to the matrices Newton–Schulz orthogonalizes
    #: (AdaMuon's sign, Mousse's whitening): ``prepare(M̃, segments, out) -> input``, batched
    #: over the ``(K, m, n)`` stack in the accumulation dtype, before DiagPre and the
    #: normalization; ``out`` is scratch of that shape it may write (``M̃`` may be ``out``).
    #: ``prepare`` and ``finish`` are closures over the live param group (a new one each step):
    #: they take no part in comparing settings, else every step would plan the stacks again
    prepare: Callable[[Tensor, list, Tensor], Tensor] | None = field(default=None,
                                                                     compare=False)
    #: a method's map from a chunk's Newton–Schulz output to its directions (Muon+'s
    #: normalization, NorMuon's second moment): ``finish(O, segments) -> directions``, batched
    #: over the ``(K, m, n)`` stack; the segments carry the rows and banked state of each part
    finish: Callable[[Tensor, list], Tensor] | None = field(default=None, compare=False)


@dataclass(eq=False)
class Segment:
    """Split ``split`` of the blocks of parameters ``lo:hi`` of a bank, inside a chunk.

    ``stack``: the segment's rows of the chunk's stack, shaped like the bank's oriented blocks;
    ``source``: what is copied there before the prologue (the bank's ``M̃`` or momentum), or
    ``None`` when ``M̃`` is formed in the stack itself (``gather``: those rows shaped
    ``(k, *stored)``) or read where it is."""

    bank: Bank
    split: int
    lo: int
    hi: int
    params: list[Tensor]
    momentum: Tensor
    #: the bank's other state of these parameters (views), by key
    state: dict[str, Tensor] = field(default_factory=dict)
    #: the segment's matrices in the chunk
    rows: slice | None = None
    stack: Tensor | None = None
    source: Tensor | None = None
    gather: Tensor | None = None

    @property
    def count(self) -> int:
        """Matrices of the segment (parameters × experts)."""
        return (self.hi - self.lo) * self.bank.layout.count


def by_segment(stack: Tensor, segments: list[Segment],
               rule: Callable[[Tensor, Segment], Tensor]) -> Tensor:
    """``rule(rows, segment)`` on each segment's rows of a chunk's ``stack`` (a method's
    ``prepare`` or ``finish`` reads the segment's banked state), the results in the chunk's
    order."""
    parts = [rule(stack[s.rows], s) for s in segments]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@dataclass(eq=False)
class Chunk:
    """Same-shape matrices stepped together: their segments, buffers and update lists.

    Buffers (views of the shared workspace, reserved in ``requests``): ``stack`` (``M̃``, then
    DiagPre's scratch; the accumulation dtype), ``iterate`` (NS input and the buffer it
    alternates with; the input is ``stack`` itself when the dtypes agree), ``gram``/``poly``
    (``(K, s, s)``), per DiagPre side (-1 rows, -2 columns) ``sums``, ``shifted`` (``sums + ε``)
    and ``scales``, ``squares`` (the column sums' scratch), ``norm``.

    The update reads the directions from ``final`` (the buffer of NS's last iterate) when they
    are in the parameters' dtype, else from ``stack`` after a copy: ``targets`` and
    ``sources[i]`` (``i`` = 0: views of ``final``, 1: of ``stack``) are the lists of the
    foreach update; ``writebacks`` the ``(stored-layout block, (from final, from stack))``
    copies of staged banks' directions, and ``completes`` the ``(params, directions)`` of the
    banks whose directions are all in their stored layout after this chunk (their blocks have
    the chunk's shape, and so its ``a``). ``step`` holds ``−a·η`` when ``η`` is a tensor
    (``capturable``).
    """

    shape: tuple[int, int]
    scale: float
    segments: list[Segment]
    requests: list[tuple] = field(default_factory=list)
    source: Tensor | None = None
    stack: Tensor | None = None
    iterate: tuple[Tensor, Tensor | None] | None = None
    gram: Tensor | None = None
    poly: Tensor | None = None
    sums: dict[int, Tensor] = field(default_factory=dict)
    shifted: dict[int, Tensor] = field(default_factory=dict)
    scales: dict[int, Tensor] = field(default_factory=dict)
    squares: Tensor | None = None
    norm: Tensor | None = None
    final: Tensor | None = None
    targets: list[Tensor] = field(default_factory=list)
    sources: tuple[list[Tensor], list[Tensor]] = ([], [])
    writebacks: list[tuple[Tensor, tuple[Tensor | None, Tensor]]] = field(default_factory=list)
    completes: list[tuple[list[Tensor], list[Tensor]]] = field(default_factory=list)
    step: Tensor | None = None
    #: the Newton–Schulz backend's stacked iteration, and its name (``ns_backend``; ``"auto"``
    #: chose per chunk)
    orthogonalize: Callable[..., Tensor] = iterate_stack
    backend: str = "torch"
    #: the stages before and after Newton–Schulz (:func:`_chunk_prologue`, :func:`_update`;
    #: compiled with ``compile=True``)
    prologue: Callable[..., Tensor] | None = None
    update: Callable[..., None] | None = None


#: DiagPre's sides per mode: the dimension summed for ``D_r`` (-1) and ``D_c`` (-2).
_SIDES = {"none": (), "R": (-1,), "C": (-2,), "RC": (-1, -2)}


def plan_stacks(plan: GroupPlan, settings: StackSettings, stack_elements: int | None,
                workspace: Workspace, chunk_bytes: int | None = None) -> list[Chunk]:
    """Bucket the blocks of a group's banks by matrix shape (and dtype, device) into chunks of
    at most ``stack_elements`` elements whose buffers take at most ``chunk_bytes`` (at least
    one parameter each) and reserve their buffers in ``workspace``; :func:`carve` gives them
    out once every group is planned."""
    if plan.banks:
        plan.decay = torch.empty((), dtype=torch.float32, device=plan.banks[0].momentum.device)
    buckets: dict[tuple, list[tuple[Bank, int]]] = {}
    for bank in plan.banks:
        for split, rows in enumerate(bank.layout.rows):
            key = ((rows, bank.layout.matrix[1]), bank.momentum.dtype, bank.momentum.device)
            buckets.setdefault(key, []).append((bank, split))
    chunks = []
    for (shape, _, _), members in buckets.items():
        per_stack = _per_stack(shape, stack_elements, sys.maxsize)
        if chunk_bytes is not None:
            one = _requests(1, shape, members[0][0].accumulate, settings)
            matrix = sum(math.prod(size) * dtype.itemsize for name, size, dtype in one
                         if name != "step")
            per_stack = min(per_stack, max(1, chunk_bytes // matrix))
        current: list[Segment] = []
        filled = 0
        for bank, split in members:
            count, lo = bank.layout.count, 0
            while lo < len(bank.params):
                if current and filled + count > per_stack:
                    chunks.append(_chunk(current, settings, workspace))
                    current, filled = [], 0
                hi = min(len(bank.params), lo + max(1, (per_stack - filled) // count))
                current.append(Segment(bank, split, lo, hi, bank.params[lo:hi],
                                       bank.momentum[lo:hi],
                                       {key: t[lo:hi] for key, t in bank.state.items()}))
                filled += (hi - lo) * count
                lo = hi
        if current:
            chunks.append(_chunk(current, settings, workspace))
    return chunks


def _chunk(segments: list[Segment], settings: StackSettings, workspace: Workspace) -> Chunk:
    bank = segments[0].bank
    shape = (bank.layout.rows[segments[0].split], bank.layout.matrix[1])
    chunk = Chunk(shape, lr_scale(shape, settings.lr_adjust), segments)
    requests = _requests(sum(s.count for s in segments), shape, bank.accumulate, settings)
    chunk.requests = [(*r, bank.momentum.device) for r in requests]
    for request in chunk.requests:
        workspace.reserve(*request)
    return chunk


def _requests(count: int, shape: tuple[int, int], accumulate: torch.dtype,
              settings: StackSettings) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The buffers of a chunk of ``count`` matrices of ``shape`` (:class:`Chunk`): name, shape
    and dtype."""
    (rows, n), small, ns = shape, min(shape), settings.dtype
    requests = [("stack", (count, rows, n), accumulate)]
    if ns != accumulate:
        requests.append(("ns_input", (count, rows, n), ns))
    if settings.algorithm != "gram":
        requests += [("ns_iterate", (count, rows, n), ns), ("ns_gram", (count, small, small), ns),
                     ("ns_poly", (count, small, small), ns)]
    for dim in _SIDES[settings.mode]:
        side = (count, rows, 1) if dim == -1 else (count, 1, n)
        requests += [(f"{name}{dim}", side, accumulate) for name in ("sums", "shifted", "scales")]
        if dim == -2:
            requests.append(("squares", (count, rows, n), accumulate))
    requests.append(("norm", (count, 1, 1), accumulate if settings.mode in ("R", "C") else ns))
    requests.append(("step", (1,), accumulate))
    return requests


def carve(chunks: list[Chunk], settings: StackSettings, workspace: Workspace) -> None:
    """Give each chunk its buffers (views of ``workspace``, all reserved before: one buffer per
    name, shared by the chunks, which run one after another), its segments' rows and its
    update lists."""
    for chunk in chunks:
        taken = {name: workspace.take(name, *rest) for name, *rest in chunk.requests}
        chunk.stack = taken["stack"]
        chunk.iterate = (taken.get("ns_input", chunk.stack), taken.get("ns_iterate"))
        chunk.gram, chunk.poly = taken.get("ns_gram"), taken.get("ns_poly")
        if chunk.iterate[1] is not None:
            chunk.final = chunk.iterate[settings.schedule.steps % 2]
        for dim in _SIDES[settings.mode]:
            chunk.sums[dim], chunk.shifted[dim], chunk.scales[dim] = (
                taken[f"{name}{dim}"] for name in ("sums", "shifted", "scales"))
        chunk.squares, chunk.norm = taken.get("squares"), taken["norm"]
        chunk.step = taken["step"].view(())
        _carve_segments(chunk, settings)
        if settings.algorithm != "gram":
            chunk.backend, chunk.orthogonalize = _backend(chunk, settings)
        chunk.prologue, chunk.update = _chunk_prologue, _update
        if settings.compile:  # MuonEq(compile=True): one graph for each stage
            chunk.prologue = _compiled(_chunk_prologue, chunk.shape)
            chunk.update = _compiled(_update, chunk.shape)
    _complete_banks(chunks)


def _backend(chunk: Chunk, settings: StackSettings) -> tuple[str, Callable[..., Tensor]]:
    """The chunk's Newton–Schulz: the group's ``ns_backend``; for ``"auto"`` on a GPU, the
    faster of torch and Triton on this chunk's buffers (one timing, at planning), torch
    elsewhere."""
    backend = settings.backend
    if callable(backend):
        return getattr(backend, "__name__", "callable"), backend_iteration(backend)
    if backend != "auto":
        return backend, backend_iteration(backend)
    X = chunk.iterate[0]
    if (X.device.type != "cuda" or X.dtype not in AGREEMENT or X.dtype == torch.float64
            or importlib.util.find_spec("triton") is None):
        return "torch", iterate_stack
    candidates = {name: backend_iteration(name) for name in ("torch", "triton")}
    name = fastest_iteration(candidates, X, settings.schedule.coefficients,
                             other=chunk.iterate[1], gram=chunk.gram, poly=chunk.poly)
    return name, candidates[name]


def _carve_segments(chunk: Chunk, settings: StackSettings) -> None:
    """Where each segment's ``M̃`` comes from and where its directions go (class docstrings)."""
    targets: list[Tensor] = []
    sources: tuple[list[Tensor], list[Tensor]] = ([], [])
    offset = 0
    for segment in chunk.segments:
        bank, layout = segment.bank, segment.bank.layout
        rows = segment.rows = slice(offset, offset + segment.count)
        oriented = layout.stacked_blocks(segment.momentum)[segment.split]
        segment.stack = chunk.stack[rows].view(oriented.shape)
        if bank.in_place:
            segment.gather = chunk.stack[rows].view(segment.momentum.shape)
            segment.source = None if settings.nesterov else oriented
        else:
            if bank.gather is None:
                bank.gather = torch.empty_like(bank.momentum)
            segment.source = (layout.stacked_blocks(bank.gather[segment.lo : segment.hi])
                              [segment.split] if settings.nesterov else oriented)
        buffers = (chunk.final, chunk.stack)
        if layout.plain:
            targets += segment.params
            for out, buffer in zip(sources, buffers, strict=True):
                if buffer is not None:
                    out += [d.view(p.shape) for d, p in zip(buffer[rows], segment.params,
                                                            strict=True)]
        elif layout.uniform:  # back to the stored layout; one update per bank, at its end
            if bank.gather is None:
                bank.gather = torch.empty_like(bank.momentum)
            back = layout.stacked_blocks(bank.gather[segment.lo : segment.hi])[segment.split]
            chunk.writebacks.append((back, tuple(
                None if b is None else b[rows].view(back.shape) for b in buffers)))
        else:  # blocks of several shapes: each updated where it lies in its parameter
            for j, p in enumerate(segment.params):
                pieces = list(layout.pieces(p))[segment.split :: len(layout.rows)]
                for e, (_, piece) in enumerate(pieces):
                    targets.append(piece)
                    for out, buffer in zip(sources, buffers, strict=True):
                        if buffer is not None:
                            index = offset + j * layout.count + e
                            out.append(buffer[index].view(piece.shape))
        offset += segment.count
    chunk.targets, chunk.sources = targets, sources
    # a lone plain segment without Nesterov is read where it is: M̃ is the momentum itself
    only = chunk.segments[0]
    if len(chunk.segments) == 1 and only.bank.in_place and not settings.nesterov:
        chunk.source, only.source = only.momentum.view(chunk.stack.shape), None
    else:
        chunk.source = chunk.stack


def _complete_banks(chunks: list[Chunk]) -> None:
    """Give the chunk that writes the last block of a staged uniform bank back that bank's
    update: its parameters, their directions in the stored layout, and ``a``."""
    last: dict[int, tuple[Bank, Chunk]] = {}
    for chunk in chunks:
        for segment in chunk.segments:
            layout = segment.bank.layout
            if not layout.plain and layout.uniform:
                last[id(segment.bank)] = (segment.bank, chunk)
    for bank, chunk in last.values():  # its blocks have the chunk's shape, and so its ``a``
        chunk.completes.append((bank.params, list(bank.gather.unbind(0))))


# ----------------------------------------------------------------------------- a stacked step
def step_stacks(plan: GroupPlan, chunks: list[Chunk], grads: list[Tensor],
                settings: UpdateSettings, stack: StackSettings, *, eps: float,
                workspace: Workspace | None = None) -> None:
    """Algorithm 1 for every matrix of a planned group, chunk by chunk (module docstring);
    ``grads`` in the order of ``plan.params``, all present and dense."""
    beta, lr = settings.momentum, settings.lr
    decay = _decay(plan, lr, settings.weight_decay)
    if decay is not None:
        torch._foreach_mul_(plan.params, decay)
    if not settings.nesterov:
        torch._foreach_lerp_(plan.momenta, grads, 1 - beta)  # line 5, every matrix at once
    else:
        for bank in plan.banks:
            if not bank.in_place:
                _momentum_and_input(bank.gather, bank.momentum, bank.params, beta)
    for chunk in chunks:
        X = chunk.prologue(chunk, stack, beta, eps)
        if stack.algorithm == "gram":
            wide = X.size(-2) <= X.size(-1)
            found = gram_iterate(X if wide else X.mT, stack.schedule.coefficients, workspace)
            found = found if wide else found.mT
        else:
            found = chunk.orthogonalize(X, stack.schedule.coefficients, other=chunk.iterate[1],
                                        gram=chunk.gram, poly=chunk.poly)
        if stack.finish is not None:
            found = stack.finish(found, chunk.segments)
        _epilogue(chunk, found, lr)


def _decay(plan: GroupPlan, lr: float | Tensor, weight_decay: float | Tensor):
    """Line 13's ``1 − η·λ``: a number, or with a tensor ``η`` or ``λ`` (``capturable``) a
    0-d tensor computed on the device (``None``: no decay)."""
    if not isinstance(lr, Tensor) and not isinstance(weight_decay, Tensor):
        return None if weight_decay == 0 else 1 - lr * weight_decay
    first, second = (lr, weight_decay) if isinstance(lr, Tensor) else (weight_decay, lr)
    return torch.mul(first, second, out=plan.decay).neg_().add_(1)


def _momentum_and_input(gather: Tensor, momentum: Tensor, params: list[Tensor],
                        beta: float) -> None:
    """Lines 5–7 on stacked rows: the gradients gathered, ``M ← lerp(M, G, 1−β)``, then
    ``M̃ = lerp(G, M, β)`` in place of ``G`` (Nesterov, as torch.optim.Muon writes it)."""
    torch.stack([p.grad for p in params], out=gather)
    momentum.lerp_(gather, 1 - beta)
    gather.lerp_(momentum, beta)


def _chunk_prologue(chunk: Chunk, stack: StackSettings, beta: float, eps: float) -> Tensor:
    """Lines 6–11 and NS's normalization for one chunk: ``M̃`` staged into its stack (Nesterov
    from the gathered gradients, or copied), the method's ``prepare``, then :func:`_prologue`."""
    _stage_input(chunk, stack.nesterov, beta)
    source = chunk.source
    if stack.prepare is not None:
        source = stack.prepare(source, chunk.segments, chunk.stack)
    return _prologue(chunk, source, stack, eps)


def _stage_input(chunk: Chunk, nesterov: bool, beta: float) -> None:
    """``M̃`` of each segment into the chunk's stack, where it is not formed there already."""
    for segment in chunk.segments:
        if segment.gather is not None and nesterov:
            _momentum_and_input(segment.gather, segment.momentum, segment.params, beta)
        elif segment.source is not None:
            segment.stack.copy_(segment.source)


def _prologue(chunk: Chunk, src: Tensor, stack: StackSettings, eps: float) -> Tensor:
    """DiagPre (line 11) and NS's normalization of the chunk's ``M̃`` (``src``), written once in
    the NS dtype: ``X₀ = D_r^{-1/2} M̃ D_c^{-1/2} / max(s·‖D_r^{-1/2} M̃ D_c^{-1/2}‖_F, ε_NS)``
    (``s``: the schedule's safety factor; ``ε_NS``: :data:`~muoneq.newton_schulz.NORM_EPS`)."""
    X = chunk.iterate[0]
    sides = _SIDES[stack.mode]
    norm_scale = stack.schedule.norm_scale
    if len(sides) == 1:  # R or C: the norm from the sums, folded into the one scale vector
        (dim,) = sides
        sums = _sums_of_squares(src, dim, chunk)
        scales = _inverse_roots(sums, chunk.shifted[dim], chunk.scales[dim], eps)
        ratios = sums.div_(chunk.shifted[dim]) if eps > 0 else sums.mul_(scales).mul_(scales)
        norm = torch.sum(ratios, dim=(-2, -1), keepdim=True, out=chunk.norm).sqrt_()
        if norm_scale != 1:
            norm.mul_(norm_scale)
        scales.div_(norm.clamp_(min=NORM_EPS))
        return torch.mul(src, scales, out=X)
    if sides:  # RC: both scales from the unscaled M̃, then the norm of the result
        rows = _inverse_roots(_sums_of_squares(src, -1, chunk), chunk.shifted[-1],
                              chunk.scales[-1], eps)
        cols = _inverse_roots(_sums_of_squares(src, -2, chunk), chunk.shifted[-2],
                              chunk.scales[-2], eps)
        torch.mul(torch.mul(src, rows, out=chunk.stack), cols, out=X)
    elif X is not src:
        X.copy_(src)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, out=chunk.norm)
    if norm_scale != 1:
        norm.mul_(norm_scale)
    return X.div_(norm.clamp_(min=NORM_EPS))


def _sums_of_squares(src: Tensor, dim: int, chunk: Chunk) -> Tensor:
    """``Σ M̃²`` along ``dim`` (-1: each row's, -2: each column's); columns square into
    scratch first (torch's norm over the strided dimension is ~9× slower on CPU)."""
    out = chunk.sums[dim]
    if dim == -1:
        return torch.linalg.vector_norm(src, dim=-1, keepdim=True, out=out).square_()
    return torch.sum(torch.square(src, out=chunk.squares), dim=-2, keepdim=True, out=out)


def _inverse_roots(sums: Tensor, shifted: Tensor, out: Tensor, eps: float) -> Tensor:
    """``(sums + ε)^{-1/2}`` into ``out`` (``shifted`` keeps ``sums + ε``); with ``ε = 0`` a
    zero sum gives 0, the pseudo-inverse of Remark 3.3."""
    torch.rsqrt(torch.add(sums, eps, out=shifted), out=out)
    return out.nan_to_num_(nan=0.0, posinf=0.0) if eps == 0 else out


def _epilogue(chunk: Chunk, found: Tensor, lr: float | Tensor) -> None:
    """Line 13's ``X ← X − a·η·O`` for every matrix of the chunk (the decay came first); a
    tensor ``η`` (``capturable``) scales the directions on the device first, as does a compiled
    update (``compile=True``: ``−a·η`` as a tensor, which a new ``η`` does not recompile)."""
    from_final = found is chunk.final and found.dtype == chunk.segments[0].momentum.dtype
    buffer = found if from_final else chunk.stack.copy_(found)
    if isinstance(lr, Tensor):
        alpha = torch.mul(lr, -chunk.scale, out=chunk.step)
    elif chunk.update is not _update:
        alpha = chunk.step.fill_(-lr * chunk.scale)
    else:
        alpha = -lr * chunk.scale
    chunk.update(chunk, buffer, 0 if from_final else 1, alpha)


def _update(chunk: Chunk, buffer: Tensor, pick: int, alpha: float | Tensor) -> None:
    """``X ← X + α·O`` from the chunk's directions (``buffer``; ``pick``: which of its update
    lists read it), a tensor ``α`` multiplied into the directions first."""
    if isinstance(alpha, Tensor):
        buffer.mul_(alpha)
        alpha = 1.0
    if chunk.targets:
        torch._foreach_add_(chunk.targets, chunk.sources[pick], alpha=alpha)
    for back, sources in chunk.writebacks:
        back.copy_(sources[pick])
    for params, found_stored in chunk.completes:
        torch._foreach_add_(params, found_stored, alpha=alpha)


def _compiled(fn: Callable, shape: tuple[int, int]) -> Callable:
    """``torch.compile(fn, fullgraph=True, dynamic=False)`` on a copy of ``fn`` with a code
    object of its own: dynamo keeps at most ``recompile_limit`` (8) graphs per code object and,
    with ``fullgraph``, fails past them; each chunk (one per shape: ResNet-18 has 10) compiles
    its own copy, named for its shape in traces."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{shape[0]}x{shape[1]}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)
    return torch.compile(copy, fullgraph=True, dynamic=False)


