"""The same stacked step when several processes share a group's matrices: each matrix has one
owner rank, which computes its direction in the chunks of its own matrices (a sub-plan of the
group's plan, :mod:`muoneq.optim.plan`), and the directions travel in buffers planned once.

* :class:`Split` — replicated parameters under DDP: the owners' matrices are contiguous runs of
  the plan's order, balanced by FLOPs (:func:`balance`); one ``all_gather`` gives every rank
  every direction, which it applies chunk by chunk, as one process does, and the state a
  method keeps of its own (NorMuon's, AdaMuon's, Mousse's), which only the owner updates:
  every rank holds all of it, as one process would;
* :class:`Sharded` — row-sharded ``DTensor`` parameters (FSDP2's ``fully_shard``): one
  ``all_to_all`` sends each rank's rows of ``M̃`` (with its rows of the method's state, and of
  the gradients where the method reads them) to the matrix's owner, which assembles the whole
  matrices in banks of its own, steps them, and a second ``all_to_all`` returns each rank its
  rows of the directions and of the updated state (the scheme of microsoft/dion), which stays
  sharded as the parameter is.

Newton–Schulz costs ``K·(4m²n + 2m³)`` FLOPs per m×n matrix (m ≤ n; see
:func:`muoneq.newton_schulz.ns_flops`) and DiagPre needs the whole matrix (column sums span
every row), hence owners. We write these exchanges by hand because torch offers no collective
that routes whole matrices of a parameter list to chosen ranks; they use only
``torch.distributed`` collectives that both gloo and NCCL implement.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from muoneq.functional import (
    Rule,
    decay_weights,
    finished,
    lr_scale,
    prologue,
    step_stacks,
    update,
)
from muoneq.newton_schulz import NSSettings, Workspace, ns_flops
from muoneq.optim.plan import (
    Bank,
    Chunk,
    GroupPlan,
    GroupStep,
    OwnRows,
    Segment,
    StackSettings,
    chunk_of,
    local,
    promoted,
    row_shard_dim,
    runs_of,
    shard_rows,
)

#: ``all_gather_single`` (torch ≥ 2.14) is the new name of ``all_gather_into_tensor``.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def balance(costs: Sequence[float], world: int) -> list[int]:
    """Owner rank of each item, in contiguous runs of the items' order: item ``i`` goes to the
    rank whose share ``[r·T/W, (r+1)·T/W)`` of the total ``T`` holds the middle of its cost.
    Every rank's load is then at most ``T/W + max(costs)``, and every rank computes the same
    assignment from the same costs."""
    total = sum(costs)
    owners, before = [], 0.0
    for cost in costs:
        middle = before + cost / 2
        owners.append(min(world - 1, int(middle * world / total)) if total > 0 else 0)
        before += cost
    return owners


def check_layouts(params: Sequence[Tensor]) -> None:
    """Refuse parameters laid out in a way no exchange here handles (:func:`row_shard_dim`),
    and a group that mixes row-sharded ``DTensor`` parameters with others (FSDP2 gathers the
    rows of every matrix of a group)."""
    sharded = [row_shard_dim(p) is not None for p in params]
    if any(sharded) and not all(sharded):
        raise ValueError(
            "params: a matrix group mixes row-sharded DTensor parameters (FSDP2's) with "
            "replicated or plain ones; put each kind in a param group of its own"
        )


def check_same_gradients(grads: Sequence[Tensor], group) -> None:
    """Raise unless every rank holds the same gradients (one fingerprint per matrix).

    Splitting the work assumes gradients were all-reduced (DDP does it); a process group used
    for something else would silently mix different models' updates.
    """
    if not grads:
        return
    prints = torch.stack([g.sum(dtype=torch.float64) for g in grads])
    low, high = prints.clone(), prints.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise RuntimeError(
            "distributed orthogonalization: gradients differ across ranks, so the matrices "
            "cannot be split between them. Wrap the model in DistributedDataParallel (or "
            "all-reduce gradients before step()), or pass distributed=False to the optimizer"
        )


# ----------------------------------------------------------------------------- exchanges
@dataclass(eq=False)
class Trip:
    """One collective over a process group: the buffer sent and the one received, the copies
    into the sent buffer before (``packs``: ``(source, view)``) and out of the received one
    after (``unpacks``: ``(view, target)``). With counts (elements per peer rank, the buffers
    grouped by peer: ``send_counts``, ``recv_counts``) an ``all_to_all_single``, each peer its
    part (FSDP2); without, an ``all_gather``, every rank's whole sent buffer to every rank, in
    rank order (DDP)."""

    send: Tensor
    received: Tensor
    packs: list[tuple[Tensor, Tensor]]
    unpacks: list[tuple[Tensor, Tensor]]
    send_counts: list[int] | None = None
    recv_counts: list[int] | None = None

    def run(self, group) -> None:
        for source, view in self.packs:
            view.copy_(source)
        if self.send_counts is None:
            _all_gather_single(self.received, self.send, group=group)
        else:
            dist.all_to_all_single(self.received, self.send, self.recv_counts,
                                   self.send_counts, group=group)
        for view, target in self.unpacks:
            target.copy_(view)


# ----------------------------------------------------------------------------- DDP
@dataclass(eq=False)
class Split:
    """DDP's exchange of a group: the rank's owned runs of the plan, its ``all_gather``
    (:class:`Trip`: the buffer it sends — its directions, in the NS dtype where the method
    finishes in it: nothing rounds twice, then the updated state of the matrices it owns — and
    the one it receives, every rank's; the owned state's rows copied in and the others' out),
    each owned chunk's view of the sent buffer (``wires``), and per chunk of the group's plan
    where its directions arrive (``(rows of the chunk's stack, received view)``)."""

    group: object
    trip: Trip | None = None
    wires: list[Tensor] = field(default_factory=list)
    arrivals: list[list[tuple[slice, Tensor]]] = field(default_factory=list)
    #: owner of each unit (a parameter's blocks of one chunk), in the plan's order
    owners: list[int] = field(default_factory=list)

    @property
    def buffers(self) -> list[Tensor]:
        return [] if self.trip is None else [self.trip.send, self.trip.received]


def _units(chunks: list[Chunk]) -> list[tuple[Chunk, Segment, int]]:
    """``(chunk, segment, parameter index in its bank)`` of every parameter's blocks, in the
    plan's order (a parameter with several splits is a unit in each of their chunks)."""
    return [(c, s, j) for c in chunks for s in c.segments for j in range(s.lo, s.hi)]


def _owned_segments(chunks: list[Chunk], owners: list[int], rank: int) -> list[list[Segment]]:
    """Per chunk, the segments of the parameters ``rank`` owns (contiguous runs of each of the
    chunk's segments), with their rows of the banks' state."""
    owned, index = [], 0
    for chunk in chunks:
        segments = []
        for segment in chunk.segments:
            mine = [j for j in range(segment.lo, segment.hi) if owners[index + j - segment.lo]
                    == rank]
            index += segment.hi - segment.lo
            if mine:
                segments.append(Segment.of(segment.bank, segment.split, mine[0], mine[-1] + 1))
        owned.append(segments)
    return owned


def _split_costs(chunks: list[Chunk], ns: NSSettings) -> list[float]:
    return [s.bank.layout.count * ns_flops(c.shape, ns.schedule.steps, ns.algorithm)
            for c, s, _ in _units(chunks)]


def _plan_split(split: Split, chunks: list[Chunk], settings: StackSettings,
                workspace: Workspace, rule: Rule) -> list[Chunk]:
    """The chunks of the runs this rank owns (reserved in ``workspace``, whose buffers they
    share with the plan's)."""
    world, rank = dist.get_world_size(split.group), dist.get_rank(split.group)
    split.owners = balance(_split_costs(chunks, settings.ns), world)
    return [chunk_of(segments, settings, workspace, rule)
            for segments in _owned_segments(chunks, split.owners, rank) if segments]


def _carve_split(split: Split, chunks: list[Chunk], owned: list[Chunk],
                 settings: StackSettings) -> None:
    """The send and receive buffers — each rank's part its directions, then the state of the
    matrices it owns —, each owned chunk's view of the send buffer, where each chunk's
    directions arrive, and the copies of the state in and out."""
    world, rank = dist.get_world_size(split.group), dist.get_rank(split.group)
    units = _units(chunks)
    sizes = [s.bank.layout.count * math.prod(c.shape) for c, s, _ in units]
    filled = [0] * world
    offsets = []
    for size, owner in zip(sizes, split.owners, strict=True):
        offsets.append(filled[owner])
        filled[owner] += size
    states = []  # (owner, state rows, offset in its part)
    for owner in range(world):
        for segment in (s for segments in _owned_segments(chunks, split.owners, owner)
                        for s in segments):
            for rows in segment.state.values():
                states.append((owner, rows, filled[owner]))
                filled[owner] += rows.numel()
    width = max(filled)
    device = chunks[0].stack.device
    dtype = settings.wire or settings.ns.dtype
    send = torch.empty(width, dtype=dtype, device=device)
    received = torch.empty(world * width, dtype=dtype, device=device)
    cursor, split.wires = 0, []
    for chunk in owned:
        size = chunk.count * math.prod(chunk.shape)
        split.wires.append(send[cursor : cursor + size].view(chunk.count, *chunk.shape))
        cursor += size
    packs, unpacks = [], []
    for owner, rows, at in states:
        if owner == rank:
            packs.append((rows, send[at : at + rows.numel()].view(rows.shape)))
        else:
            start = owner * width + at
            unpacks.append((received[start : start + rows.numel()].view(rows.shape), rows))
    split.trip = Trip(send, received, packs, unpacks)
    split.arrivals, u = [], 0
    for chunk in chunks:
        runs: list[list[int]] = []  # [first row, last row, start in received, owner]
        row, size = 0, math.prod(chunk.shape)
        for segment in chunk.segments:
            for _ in range(segment.lo, segment.hi):
                count, owner = segment.bank.layout.count, split.owners[u]
                start = owner * width + offsets[u]
                if runs and runs[-1][3] == owner and runs[-1][2] + (
                        runs[-1][1] - runs[-1][0]) * size == start:
                    runs[-1][1] = row + count
                else:
                    runs.append([row, row + count, start, owner])
                row, u = row + count, u + 1
        split.arrivals.append([
            (chunk.stack[first:last], received[start : start + (last - first) * size]
             .view(last - first, *chunk.shape)) for first, last, start, _ in runs])


# ----------------------------------------------------------------------------- FSDP2
#: Per peer rank, the parts of one side of a :class:`Trip` in order: ``(shape, tensor)``, the
#: tensor copied in (sent) or out (received); ``None``: the step writes the sent view itself.
Parts = list[list[tuple[tuple[int, ...], Tensor | None]]]


def _trip(sent: Parts, received: Parts, dtype: torch.dtype, device: torch.device
          ) -> tuple[Trip, list[Tensor]]:
    """The :class:`Trip` of ``sent`` and ``received``, and the sent views the step writes
    (the parts without a tensor), in order."""

    def carve(side: Parts) -> tuple[Tensor, list[int], list[tuple[Tensor, Tensor | None]]]:
        counts = [sum(math.prod(shape) for shape, _ in parts) for parts in side]
        flat = torch.empty(sum(counts), dtype=dtype, device=device)
        views, at = [], 0
        for shape, tensor in (part for parts in side for part in parts):
            views.append((flat[at : at + math.prod(shape)].view(shape), tensor))
            at += math.prod(shape)
        return flat, counts, views

    send, send_counts, sent_views = carve(sent)
    receive, recv_counts, received_views = carve(received)
    trip = Trip(send, receive, [(t, v) for v, t in sent_views if t is not None],
                received_views, send_counts, recv_counts)
    return trip, [v for v, t in sent_views if t is None]


@dataclass(eq=False)
class Sharded:
    """FSDP2's exchange of a group: who owns each parameter, the whole banks this rank assembles
    for the parameters it owns (one per run of a bank's parameters: ``M̃``, the method's state,
    and the gradients where it reads them), and the two trips (:class:`Trip`): ``there``, each
    rank's rows of those to their owners, and ``back``, the owners' directions and updated
    state to each rank, its rows."""

    plan: GroupPlan
    mesh: object
    dim: int
    #: owner rank of each parameter (``id``), and the parameters with a gradient
    owners: dict[int, int]
    present: set[int]
    banks: list[Bank] = field(default_factory=list)
    there: Trip | None = None
    back: Trip | None = None
    #: ``(parameters, their momentum rows, M̃ view, gradient view)``: what this rank forms in
    #: ``there``'s send buffer for a run (the gradients' view ``None`` unless the method reads
    #: them)
    outgoing: list[tuple[list[Tensor], Tensor, Tensor, Tensor | None]] = field(
        default_factory=list)
    #: this rank's rows of each local bank's directions, in the parameters' dtype
    directions: list[Tensor] = field(default_factory=list)
    #: the local update: per block shape ``(a, alpha, params' pieces, directions' pieces)``,
    #: ``alpha`` the 0-d buffer of ``−a·η`` for a tensor ``η`` (``capturable``)
    updates: list[tuple[float, Tensor, list[Tensor], list[Tensor]]] = field(
        default_factory=list)

    @property
    def buffers(self) -> list[Tensor]:
        trips = [t for trip in (self.there, self.back) if trip is not None
                 for t in (trip.send, trip.received)]
        assembled = [t for bank in self.banks
                     for t in (*bank.state.values(), bank.gradient) if t is not None]
        return [*trips, *assembled, *self.directions, *(alpha for _, alpha, *_ in self.updates)]

    @property
    def group(self):
        return self.mesh.get_group(self.dim)

    @property
    def world(self) -> int:
        return self.mesh.size(self.dim)

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank(self.dim)

    @classmethod
    def of(cls, plan: GroupPlan, present: Sequence[bool], rule: Rule) -> Sharded:
        """The owners of a sharded group's parameters (balanced by FLOPs, over the plan's
        banks in order) and the whole banks of the runs this rank owns (with the gradients
        where ``rule`` reads them)."""
        p0 = plan.params[0]
        dim = row_shard_dim(p0)
        mesh = p0.device_mesh
        ordered = [p for bank in plan.banks for p in bank.params]
        layouts = {id(p): layout for p, layout in zip(plan.params, plan.layouts, strict=True)}
        costs = [sum(ns_flops(b, 5) for b in layouts[id(p)].blocks) for p in ordered]
        owners = balance(costs, mesh.size(dim))
        sharded = cls(plan, mesh, dim, {id(p): o for p, o in zip(ordered, owners, strict=True)},
                      {id(p) for p, ok in zip(plan.params, present, strict=True) if ok})
        for bank in plan.banks:
            like = {"device": bank.momentum.device}
            for lo, hi in sharded.runs(bank, sharded.rank):
                whole = torch.empty((hi - lo, *bank.layout.stored), dtype=bank.momentum.dtype,
                                    **like)
                state = {key: torch.empty((hi - lo, *bank.shapes[key]), dtype=t.dtype, **like)
                         for key, t in bank.state.items()}
                gradients = (torch.empty((hi - lo, *bank.layout.stored), dtype=bank.accumulate,
                                         **like) if rule.reads_gradient else None)
                sharded.banks.append(Bank(bank.params[lo:hi], bank.layout, whole, state,
                                          dict(bank.shapes), gather=whole, assembled=True,
                                          gradient=gradients))
        return sharded

    def runs(self, bank: Bank, peer: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each run of the bank's parameters with a gradient that ``peer``
        steps."""
        return runs_of([id(p) in self.present and self.owners[id(p)] == peer
                        for p in bank.params])


def computed_banks(plan: GroupPlan, exchange) -> list[Bank]:
    """The banks whose matrices this process steps in chunks: the group's own, or under FSDP2
    the whole banks it assembles (:class:`Sharded`)."""
    return exchange.banks if isinstance(exchange, Sharded) else plan.banks


def plan_exchange(exchange, chunks: list[Chunk], settings: StackSettings,
                  workspace: Workspace, rule: Rule) -> list[Chunk]:
    """DDP: the chunks of the runs this rank owns (reserved in ``workspace``); otherwise
    none."""
    if isinstance(exchange, Split):
        return _plan_split(exchange, chunks, settings, workspace, rule)
    return []


def carve_exchange(exchange, chunks: list[Chunk], owned: list[Chunk],
                   settings: StackSettings, rule: Rule) -> None:
    """The exchange's buffers and the copies in and out of them, once per plan."""
    if isinstance(exchange, Split) and chunks:
        _carve_split(exchange, chunks, owned, settings)
    elif isinstance(exchange, Sharded):
        _carve_sharded(exchange, settings, rule.reads_gradient)


def _carve_sharded(sharded: Sharded, settings: StackSettings, gradient: bool) -> None:
    """The two trips, grouped by peer rank and within a peer by the runs the owner steps in the
    plan's bank order, the same order on the sending and the owning side: per run ``M̃`` (and
    the gradients) in the accumulation dtype, then each state's rows, ``there``; the
    directions (in the NS dtype where the method finishes in it) and each state's rows,
    ``back``. A state's rows are those of its own first dimension (its ``Shard(0)``); a 0-d
    state travels whole from every rank and to every rank. ``gradient``: the method reads whole
    gradients (:attr:`~muoneq.functional.Rule.reads_gradient`), which travel with ``M̃``."""
    plan, world = sharded.plan, sharded.world
    bank0 = plan.banks[0]
    device, keys = bank0.momentum.device, list(bank0.state)
    there: tuple[Parts, Parts] = ([[] for _ in range(world)], [[] for _ in range(world)])
    back: tuple[Parts, Parts] = ([[] for _ in range(world)], [[] for _ in range(world)])
    sharded.directions = [torch.empty_like(bank.momentum) for bank in plan.banks]
    formed = []
    for peer in range(world):
        for bank, directions in zip(plan.banks, sharded.directions, strict=True):
            for lo, hi in sharded.runs(bank, peer):
                rows = bank.momentum[lo:hi]
                there[0][peer] += [(rows.shape, None)] * (2 if gradient else 1)
                back[1][peer].append((rows.shape, directions[lo:hi]))
                formed.append((bank.params[lo:hi], rows))
                for key in keys:
                    state = bank.state[key][lo:hi]
                    there[0][peer].append((state.shape, state))
                    back[1][peer].append((state.shape, state))
        for whole in sharded.banks:
            first, count = shard_rows(whole.layout.stored[0], world)[peer]
            gathered = whole.gather[:, first : first + count]
            there[1][peer].append((gathered.shape, gathered))
            back[0][peer].append((gathered.shape, gathered))
            if gradient:
                gradients = whole.gradient[:, first : first + count]
                there[1][peer].append((gradients.shape, gradients))
            for key in keys:
                shape, state = whole.shapes[key], whole.state[key]
                if shape:
                    start, length = shard_rows(shape[0], world)[peer]
                    state = state[:, start : start + length]
                there[1][peer].append((state.shape, state))
                back[0][peer].append((state.shape, state))
    states = [t.dtype for t in bank0.state.values()]
    sharded.there, views = _trip(*there, promoted(bank0.accumulate, *states), device)
    sharded.back, _ = _trip(*back, promoted(settings.wire or settings.ns.dtype, *states),
                            device)
    step = 2 if gradient else 1
    sharded.outgoing = [(params, rows, views[step * i],
                         views[step * i + 1] if gradient else None)
                        for i, (params, rows) in enumerate(formed)]
    rows_of = {id(bank): d for bank, d in zip(plan.banks, sharded.directions, strict=True)}
    by_shape: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}
    for bank in plan.banks:
        start = OwnRows.of(bank.params[0], bank.params[0].shape).start
        for p, d in zip(bank.params, rows_of[id(bank)].unbind(0), strict=True):
            if id(p) not in sharded.present:
                continue
            for (shape, piece), (_, dpiece) in zip(bank.layout.pieces(local(p), start),
                                                   bank.layout.pieces(d, start), strict=True):
                targets, sources = by_shape.setdefault(shape, ([], []))
                targets.append(piece)
                sources.append(dpiece)
    alphas = torch.empty(len(by_shape), dtype=bank0.accumulate, device=device).unbind(0)
    sharded.updates = [(lr_scale(shape, settings.lr_adjust), alpha, *lists)
                       for alpha, (shape, lists) in zip(alphas, by_shape.items(), strict=True)]


# ----------------------------------------------------------------------------- the step
def step_exchanged(step: GroupStep, grads: list[Tensor], *, rule: Rule, group: dict,
                   lr: float | Tensor, weight_decay: float | Tensor, beta: float,
                   nesterov: bool, mode: str, eps: float, ns: NSSettings,
                   decay: Tensor | None = None, compiled: dict | None = None) -> None:
    """:func:`muoneq.functional.step_stacks` with the matrices shared out between processes
    (``step.exchange``: :class:`Split` or :class:`Sharded`)."""
    compiled = compiled or {}
    exchange = step.exchange
    if isinstance(exchange, Split):  # the owned chunks' directions sent, then applied here
        step_stacks(step.exchanged, step.weights, grads, step.momenta, rule=rule, group=group,
                    lr=lr, weight_decay=weight_decay, beta=beta, nesterov=nesterov, mode=mode,
                    eps=eps, ns=ns, decay=decay, compiled=compiled, sent=exchange.wires)
        exchange.trip.run(exchange.group)  # the directions and the owned matrices' state
        for chunk, arrivals in zip(step.chunks, exchange.arrivals, strict=True):
            for rows, view in arrivals:
                rows.copy_(view)
            update(chunk, chunk.stack, lr, compiled.get(("update", chunk.shape)))  # line 13
        return
    decay_weights(step.weights, lr, weight_decay, decay)            # line 13's (1 − ηλ), first
    torch._foreach_lerp_(step.momenta, grads, 1 - beta)             # line 5, this rank's rows
    _send_rows(exchange, nesterov, beta)
    for chunk in step.chunks:
        X = compiled.get(("prologue", chunk.shape), prologue)(
            chunk, rule, group, nesterov=nesterov, beta=beta, eps=eps, mode=mode,
            norm_scale=ns.schedule.norm_scale)                      # lines 6–11
        O = chunk.iteration.iterate(X, ns.schedule.coefficients, chunk.ns_buffers)  # line 12
        # an assembled bank's directions go back into its stored layout, for the return
        update(chunk, finished(chunk, O, rule, group), 0.0)
    _return_rows(exchange, lr)


def _send_rows(sharded: Sharded, nesterov: bool, beta: float) -> None:
    """This rank's rows of ``M̃`` (and of the gradients and the state) to the owners, assembled
    there into whole banks."""
    for params, momentum, view, gradients in sharded.outgoing:
        if nesterov:
            torch.stack([local(p.grad) for p in params], out=view)
            view.lerp_(momentum, beta)
        else:
            view.copy_(momentum)
        if gradients is not None:
            torch.stack([local(p.grad) for p in params], out=gradients)
    sharded.there.run(sharded.group)


def _return_rows(sharded: Sharded, lr: float | Tensor) -> None:
    """The owned directions' rows (and the updated state's) back to their ranks, and line 13
    on this rank's rows."""
    sharded.back.run(sharded.group)
    for scale, alpha, targets, sources in sharded.updates:
        if isinstance(lr, Tensor):  # capturable: −a·η computed on the device
            torch._foreach_mul_(sources, torch.mul(lr, -scale, out=alpha))
            torch._foreach_add_(targets, sources)
        else:
            torch._foreach_add_(targets, sources, alpha=-lr * scale)
