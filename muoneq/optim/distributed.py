"""The same stacked step when several processes share a group's matrices: each matrix has one
owner rank, which computes its direction in the chunks of its own matrices (a sub-plan of the
group's plan, :mod:`muoneq.optim.plan`), and the directions travel in buffers planned once.

* :class:`Split` — replicated parameters under DDP: the owners' matrices are contiguous runs of
  the plan's order, balanced by FLOPs (:func:`balance`); one ``all_gather`` gives every rank
  every direction, which it applies chunk by chunk, as one process does;
* :class:`Sharded` — row-sharded ``DTensor`` parameters (FSDP2's ``fully_shard``): one
  ``all_to_all`` sends each rank's rows of ``M̃`` to the matrix's owner, which assembles the
  whole matrices in banks of its own, steps them, and a second ``all_to_all`` returns each
  rank its rows of the directions (the scheme of microsoft/dion). A method with state of its
  own (NorMuon, AdaMuon, Mousse) has every rank own every matrix.

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
    stage_banks,
    update,
)
from muoneq.newton_schulz import NSSettings, Workspace, ns_flops
from muoneq.optim.plan import (
    Bank,
    Chunk,
    GroupPlan,
    GroupStep,
    Segment,
    StackSettings,
    chunk_of,
    is_dtensor,
    local,
    runs_of,
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


def shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each rank's rows under ``Shard(0)`` (``torch.chunk``'s rule)."""
    size = -(-rows // world)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(world)]


def row_shard_dim(p: Tensor) -> int | None:
    """The mesh dimension along which ``p`` is sharded by rows, ``None`` if it is not.

    Plain tensors and fully replicated ``DTensor``s give ``None``; ``Shard(0)`` on one mesh
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


def check_layout(p: Tensor) -> None:
    """Refuse a parameter laid out in a way no exchange here handles (:func:`row_shard_dim`)."""
    row_shard_dim(p)


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


# ----------------------------------------------------------------------------- DDP
@dataclass(eq=False)
class Split:
    """DDP's exchange of a group: the rank's owned runs of the plan, the buffer it sends (its
    directions, in the NS dtype: nothing rounds twice) and the one it receives (every rank's),
    and per chunk of the group's plan where its directions arrive (``(rows of the chunk's
    stack, received view)``)."""

    group: object
    send: Tensor | None = None
    received: Tensor | None = None
    wires: list[Tensor] = field(default_factory=list)
    arrivals: list[list[tuple[slice, Tensor]]] = field(default_factory=list)
    #: owner of each unit (a parameter's blocks of one chunk), in the plan's order
    owners: list[int] = field(default_factory=list)

    @property
    def buffers(self) -> list[Tensor]:
        return [t for t in (self.send, self.received) if t is not None]


def _units(chunks: list[Chunk]) -> list[tuple[Chunk, Segment, int]]:
    """``(chunk, segment, parameter index in its bank)`` of every parameter's blocks, in the
    plan's order (a parameter with several splits is a unit in each of their chunks)."""
    return [(c, s, j) for c in chunks for s in c.segments for j in range(s.lo, s.hi)]


def _owned_chunks(chunks: list[Chunk], owners: list[int], rank: int, settings: StackSettings,
                  workspace: Workspace) -> list[Chunk]:
    """The runs of ``chunks`` this rank owns, as chunks of their own (reserved in
    ``workspace``, whose buffers they share with the plan's)."""
    owned, index = [], 0
    for chunk in chunks:
        segments = []
        for segment in chunk.segments:
            mine = [j for j in range(segment.lo, segment.hi) if owners[index + j - segment.lo]
                    == rank]
            index += segment.hi - segment.lo
            if mine:
                lo, hi = mine[0], mine[-1] + 1
                bank = segment.bank
                segments.append(Segment(bank, segment.split, lo, hi, bank.params[lo:hi],
                                        bank.momentum[lo:hi],
                                        {key: t[lo:hi] for key, t in bank.state.items()}))
        if segments:
            owned.append(chunk_of(segments, settings, workspace))
    return owned


def _split_costs(chunks: list[Chunk], ns: NSSettings) -> list[float]:
    return [s.bank.layout.count * ns_flops(c.shape, ns.schedule.steps, ns.algorithm)
            for c, s, _ in _units(chunks)]


def _plan_split(split: Split, chunks: list[Chunk], settings: StackSettings,
                workspace: Workspace) -> list[Chunk]:
    world, rank = dist.get_world_size(split.group), dist.get_rank(split.group)
    split.owners = balance(_split_costs(chunks, settings.ns), world)
    return _owned_chunks(chunks, split.owners, rank, settings, workspace)


def _carve_split(split: Split, chunks: list[Chunk], owned: list[Chunk],
                 settings: StackSettings) -> None:
    """The send and receive buffers, each owned chunk's view of the send buffer, and where each
    chunk's directions arrive."""
    world = dist.get_world_size(split.group)
    units = _units(chunks)
    sizes = [s.bank.layout.count * math.prod(c.shape) for c, s, _ in units]
    filled = [0] * world
    offsets = []
    for size, owner in zip(sizes, split.owners, strict=True):
        offsets.append(filled[owner])
        filled[owner] += size
    width = max(filled)
    device = chunks[0].stack.device
    dtype = settings.wire or settings.ns.dtype
    split.send = torch.empty(width, dtype=dtype, device=device)
    split.received = torch.empty(world * width, dtype=dtype, device=device)
    cursor, split.wires = 0, []
    for chunk in owned:
        size = chunk.count * math.prod(chunk.shape)
        split.wires.append(split.send[cursor : cursor + size].view(chunk.count, *chunk.shape))
        cursor += size
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
            (chunk.stack[first:last], split.received[start : start + (last - first) * size]
             .view(last - first, *chunk.shape)) for first, last, start, _ in runs])


# ----------------------------------------------------------------------------- FSDP2
@dataclass(eq=False)
class Sharded:
    """FSDP2's exchange of a group: who owns each parameter, the whole banks this rank assembles
    for the parameters it owns (one per run of a bank's parameters), and the four buffers of
    the two ``all_to_all`` calls with the copies in and out of them."""

    plan: GroupPlan
    mesh: object
    dim: int
    #: owner rank of each parameter (``id``), and the parameters with a gradient
    owners: dict[int, int]
    present: set[int]
    #: every rank owns every matrix (a method with state of its own)
    everyone: bool
    banks: list[Bank] = field(default_factory=list)
    send: Tensor | None = None
    received: Tensor | None = None
    back: Tensor | None = None
    returned: Tensor | None = None
    send_counts: list[int] = field(default_factory=list)
    recv_counts: list[int] = field(default_factory=list)
    #: ``(parameters, their momentum rows, send view)``: this rank's rows of ``M̃`` of a run,
    #: to its owner
    outgoing: list[tuple[list[Tensor], Tensor, Tensor]] = field(default_factory=list)
    #: ``(received view, whole bank rows)``: a peer's rows of a run this rank owns
    assembling: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    #: ``(whole bank rows, back view)``: an owned run's directions, a peer's rows
    returning: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    #: ``(returned view, local directions)``: this rank's rows of a run's directions
    arriving: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    #: this rank's rows of each local bank's directions, in the parameters' dtype
    directions: list[Tensor] = field(default_factory=list)
    #: the local update: per block shape ``(a, params' pieces, directions' pieces)``
    updates: list[tuple[float, list[Tensor], list[Tensor]]] = field(default_factory=list)

    @property
    def buffers(self) -> list[Tensor]:
        return [t for t in (self.send, self.received, self.back, self.returned,
                            *self.directions) if t is not None]

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
    def of(cls, plan: GroupPlan, present: Sequence[bool], *, everyone: bool) -> Sharded:
        """The owners of a sharded group's parameters (balanced by FLOPs, over the plan's
        banks in order) and the whole banks of the runs this rank owns."""
        p0 = plan.params[0]
        dim = row_shard_dim(p0)
        mesh = p0.device_mesh
        ordered = [p for bank in plan.banks for p in bank.params]
        layouts = {id(p): layout for p, layout in zip(plan.params, plan.layouts, strict=True)}
        costs = [sum(ns_flops(b, 5) for b in layouts[id(p)].blocks) for p in ordered]
        owners = balance(costs, mesh.size(dim))
        sharded = cls(plan, mesh, dim, {id(p): o for p, o in zip(ordered, owners, strict=True)},
                      {id(p) for p, ok in zip(plan.params, present, strict=True) if ok},
                      everyone)
        for bank in plan.banks:
            for lo, hi in sharded.runs(bank, sharded.rank):
                whole = torch.empty((hi - lo, *bank.layout.stored), dtype=bank.momentum.dtype,
                                    device=bank.momentum.device)
                sharded.banks.append(Bank(bank.params[lo:hi], bank.layout, whole,
                                          {key: t[lo:hi] for key, t in bank.state.items()},
                                          gather=whole, assembled=True))
        return sharded

    def runs(self, bank: Bank, peer: int) -> list[tuple[int, int]]:
        """``(lo, hi)`` of each run of the bank's parameters with a gradient that ``peer``
        steps."""
        flags = [id(p) in self.present and (self.everyone or self.owners[id(p)] == peer)
                 for p in bank.params]
        return runs_of(flags)


def computed_banks(plan: GroupPlan, exchange) -> list[Bank]:
    """The banks whose matrices this process steps in chunks: the group's own, or under FSDP2
    the whole banks it assembles (:class:`Sharded`)."""
    return exchange.banks if isinstance(exchange, Sharded) else plan.banks


def plan_exchange(exchange, chunks: list[Chunk], settings: StackSettings,
                  workspace: Workspace) -> list[Chunk]:
    """DDP: the chunks of the runs this rank owns (reserved in ``workspace``); otherwise
    none."""
    if isinstance(exchange, Split):
        return _plan_split(exchange, chunks, settings, workspace)
    return []


def carve_exchange(exchange, chunks: list[Chunk], owned: list[Chunk],
                   settings: StackSettings) -> None:
    """The exchange's buffers and the copies in and out of them, once per plan."""
    if isinstance(exchange, Split) and chunks:
        _carve_split(exchange, chunks, owned, settings)
    elif isinstance(exchange, Sharded):
        _carve_sharded(exchange, settings)


def _carve_sharded(sharded: Sharded, settings: StackSettings) -> None:
    """Buffers of the two ``all_to_all`` calls — ``M̃`` in the accumulation dtype, directions in
    the NS dtype — grouped by peer rank, and within a peer by the runs the peer steps in the
    plan's bank order (``(k, rows, …)`` each): the same order on the sending and the owning
    side."""
    plan, world = sharded.plan, sharded.world
    bank0 = plan.banks[0]
    device, accumulate = bank0.momentum.device, bank0.accumulate
    outgoing, assembling = [], []
    send_counts, recv_counts, sent, received = [], [], 0, 0
    for peer in range(world):
        start = sent
        for bank in plan.banks:
            for lo, hi in sharded.runs(bank, peer):
                outgoing.append((bank, lo, hi, sent))
                sent += (hi - lo) * math.prod(bank.momentum.shape[1:])
        send_counts.append(sent - start)
        start = received
        for whole in sharded.banks:
            first, rows = shard_rows(whole.layout.stored[0], world)[peer]
            assembling.append((whole, first, rows, received))
            received += len(whole.params) * rows * math.prod(whole.layout.stored[1:])
        recv_counts.append(received - start)
    sharded.send_counts, sharded.recv_counts = send_counts, recv_counts
    sharded.send = torch.empty(sent, dtype=accumulate, device=device)
    wire = settings.wire or settings.ns.dtype
    sharded.returned = torch.empty(sent, dtype=wire, device=device)
    sharded.received = torch.empty(received, dtype=accumulate, device=device)
    sharded.back = torch.empty(received, dtype=wire, device=device)
    sharded.directions = [torch.empty_like(bank.momentum) for bank in plan.banks]
    rows_of = {id(bank): d for bank, d in zip(plan.banks, sharded.directions, strict=True)}
    sharded.outgoing, sharded.arriving = [], []
    for bank, lo, hi, at in outgoing:
        shape, size = (hi - lo, *bank.momentum.shape[1:]), (hi - lo) * math.prod(
            bank.momentum.shape[1:])
        sharded.outgoing.append((bank.params[lo:hi], bank.momentum[lo:hi],
                                 sharded.send[at : at + size].view(shape)))
        sharded.arriving.append((sharded.returned[at : at + size].view(shape),
                                 rows_of[id(bank)][lo:hi]))
    sharded.assembling, sharded.returning = [], []
    for whole, first, rows, at in assembling:
        shape = (len(whole.params), rows, *whole.layout.stored[1:])
        size, target = math.prod(shape), whole.gather[:, first : first + rows]
        sharded.assembling.append((sharded.received[at : at + size].view(shape), target))
        sharded.returning.append((target, sharded.back[at : at + size].view(shape)))
    by_shape: dict[tuple[int, int], tuple[list[Tensor], list[Tensor]]] = {}
    for bank in plan.banks:
        start = row_offset(bank.params[0])
        for p, d in zip(bank.params, rows_of[id(bank)].unbind(0), strict=True):
            if id(p) not in sharded.present:
                continue
            for (shape, piece), (_, dpiece) in zip(bank.layout.pieces(local(p), start),
                                                   bank.layout.pieces(d, start), strict=True):
                targets, sources = by_shape.setdefault(shape, ([], []))
                targets.append(piece)
                sources.append(dpiece)
    sharded.updates = [(lr_scale(shape, settings.lr_adjust), *lists)
                       for shape, lists in by_shape.items()]


def row_offset(p: Tensor) -> int:
    """The first stored row of ``p`` this rank holds: 0 unless ``p`` is row-sharded."""
    dim = row_shard_dim(p)
    if dim is None:
        return 0
    mesh = p.device_mesh
    return shard_rows(p.shape[0], mesh.size(dim))[mesh.get_local_rank(dim)][0]


# ----------------------------------------------------------------------------- the step
def step_exchanged(step: GroupStep, grads: list[Tensor], *, rule: Rule, group: dict,
                   lr: float | Tensor, weight_decay: float | Tensor, beta: float,
                   nesterov: bool, mode: str, eps: float, ns: NSSettings,
                   decay: Tensor | None = None, compiled: dict | None = None) -> None:
    """:func:`muoneq.functional.step_stacks` with the matrices shared out between processes
    (``step.exchange``: :class:`Split` or :class:`Sharded`)."""
    compiled = compiled or {}
    local_params = [local(p) for p in step.params]
    decay_weights(local_params, lr, weight_decay, decay)            # line 13's (1 − ηλ), first
    torch._foreach_lerp_(step.momenta, grads, 1 - beta)             # line 5, this rank's rows
    exchange = step.exchange
    computed = step.exchanged if isinstance(exchange, Split) else step.chunks
    if isinstance(exchange, Sharded):
        _send_rows(exchange, nesterov, beta)
    else:
        stage_banks(computed, nesterov, beta)
    for i, chunk in enumerate(computed):
        X = compiled.get(("prologue", chunk.shape), prologue)(
            chunk, rule, group, nesterov=nesterov, beta=beta, eps=eps, mode=mode,
            norm_scale=ns.schedule.norm_scale)
        O = chunk.iteration.iterate(X, ns.schedule.coefficients, chunk.ns_buffers)
        directions = finished(chunk, O, rule, group)
        if isinstance(exchange, Split):
            exchange.wires[i].copy_(directions)
        else:  # an assembled bank's directions go back into its stored layout, for the return
            update(chunk, directions, 0.0)
    if isinstance(exchange, Split):
        _all_gather_single(exchange.received, exchange.send, group=exchange.group)
        for chunk, arrivals in zip(step.chunks, exchange.arrivals, strict=True):
            for rows, view in arrivals:
                rows.copy_(view)
            update(chunk, chunk.stack, lr, compiled.get(("update", chunk.shape)))
    else:
        _return_rows(exchange, lr)


def _send_rows(sharded: Sharded, nesterov: bool, beta: float) -> None:
    """This rank's rows of ``M̃`` to the owners, assembled there into whole banks."""
    for params, momentum, view in sharded.outgoing:
        if nesterov:
            torch.stack([local(p.grad) for p in params], out=view)
            view.lerp_(momentum, beta)
        else:
            view.copy_(momentum)
    dist.all_to_all_single(sharded.received, sharded.send, sharded.recv_counts,
                           sharded.send_counts, group=sharded.group)
    for view, target in sharded.assembling:
        target.copy_(view)


def _return_rows(sharded: Sharded, lr: float | Tensor) -> None:
    """The owned directions' rows back to their ranks, and line 13 on this rank's rows."""
    for target, view in sharded.returning:
        view.copy_(target)
    dist.all_to_all_single(sharded.returned, sharded.back, sharded.send_counts,
                           sharded.recv_counts, group=sharded.group)
    for view, rows in sharded.arriving:
        rows.copy_(view)
    for scale, targets, sources in sharded.updates:
        if isinstance(lr, Tensor):  # capturable: −a·η computed on the device
            torch._foreach_mul_(sources, torch.mul(lr, -scale))
            torch._foreach_add_(targets, sources)
        else:
            torch._foreach_add_(targets, sources, alpha=-lr * scale)

