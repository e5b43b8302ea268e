"""Orthogonalization across ranks: a FLOP-balanced split under DDP, whole matrices under FSDP2.

Newton–Schulz costs ``K·(4m²n + 2m³)`` FLOPs per m×n matrix (m ≤ n, standard order; see
:func:`muoneq.newton_schulz.ns_flops`) and DiagPre needs the whole matrix (column sums
span every row), so with several processes the optimizer step is organized around
*owners*: every matrix of a step is given to one rank, chosen so that each rank's FLOPs
stay within ``total/W + largest`` (:func:`balance`, greedy longest-processing-time).
Two layouts are handled:

* **replicated** parameters (plain tensors, as under DDP): every rank already holds every
  (all-reduced) gradient and updates its own momentum; the owner computes the direction and
  one ``all_gather_into_tensor`` gives every rank every direction (:func:`exchange_replicated`);
* **row-sharded** parameters (``DTensor`` with ``Shard(0)``, as under FSDP2's
  ``fully_shard``): one ``all_to_all`` sends each rank's rows of the (Nesterov-mixed) momentum
  to the owner, which assembles the whole matrix, and a second one sends each rank its rows of
  the direction (:func:`exchange_row_sharded`), the scheme of microsoft/dion. Momentum stays
  sharded like its parameter.

Directions that are not a pure function of the momentum (methods with state of their own)
cannot be split: for sharded parameters :func:`full_tensor` gathers whole matrices on every
rank instead. We write these exchanges by hand because torch offers no collective that
routes whole matrices of a parameter list to chosen ranks; they use only
``torch.distributed`` collectives that both gloo and NCCL implement.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

#: ``all_gather_single`` (torch ≥ 2.14) is the new name of ``all_gather_into_tensor``.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: ``sink(slot, direction)``: receives the whole-matrix direction of one slot.
Sink = Callable[["MatrixSlot", Tensor], None]
#: ``compute(items, sink)``: computes the directions of ``(slot, m̃ thunk)`` items, calls sink.
Compute = Callable[[list, Sink], None]


@dataclass(eq=False)
class MatrixSlot:
    """One matrix parameter in one optimizer step, as this rank sees it.

    ``value``, ``grad`` and ``momentum`` are the local tensors (a ``DTensor``'s local shard,
    updated in place); ``shape`` is the global matrix shape ``(out, in·kh·kw)``.
    """

    param: Tensor
    value: Tensor
    grad: Tensor
    momentum: Tensor
    shape: tuple[int, int]

    def m_tilde(self, beta: float, nesterov: bool, out: Tensor | None = None) -> Tensor:
        """The local (Nesterov-mixed) momentum ``M̃`` (Algorithm 1, line 7), written into
        ``out`` (a new tensor without it): scratch that the caller may overwrite."""
        if out is None:
            out = torch.empty_like(self.grad)
        if nesterov:
            return torch.lerp(self.grad, self.momentum, beta, out=out)
        return out.copy_(self.momentum)


def is_dtensor(t) -> bool:
    """``isinstance(t, DTensor)`` without importing ``torch.distributed.tensor`` (slow to
    import): no DTensor can exist before that module is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, any other tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def balance(costs: Sequence[float], world: int) -> list[int]:
    """Owner rank of each item, greedy longest-processing-time first.

    Each item goes to the currently least-loaded rank, largest items first, so every rank's
    load is at most ``sum(costs)/world + max(costs)``. Ties break by index and rank: every
    rank computes the same assignment from the same costs.
    """
    heap = [(0.0, rank) for rank in range(world)]
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (load + costs[i], rank))
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


def check_same_gradients(slots: Sequence[MatrixSlot], group) -> None:
    """Raise unless every rank holds the same gradients (one fingerprint per matrix).

    Splitting the work assumes gradients were all-reduced (DDP does it); a process group used
    for something else would silently mix different models' updates.
    """
    if not slots:
        return
    prints = torch.stack([s.grad.sum(dtype=torch.float64) for s in slots])
    low, high = prints.clone(), prints.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise RuntimeError(
            "distributed orthogonalization: gradients differ across ranks, so the matrices "
            "cannot be split between them. Wrap the model in DistributedDataParallel (or "
            "all-reduce gradients before step()), or pass distributed=False to the optimizer"
        )


def exchange_replicated(
    slots: Sequence[MatrixSlot],
    thunks: Sequence[Callable[[], Tensor]],
    compute: Compute,
    apply: Sink,
    *,
    costs: Sequence[float],
    dtype: torch.dtype,
    group=None,
) -> None:
    """DDP: each rank computes the directions it owns, then all ranks receive all of them.

    ``thunks[i]()`` gives slot ``i``'s whole-matrix ``M̃`` (called on its owner only) and
    ``costs[i]`` its FLOPs (what :func:`balance` evens out);
    directions travel in ``dtype`` (the Newton–Schulz dtype, so nothing is rounded twice).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owners = balance(costs, world)
    offsets, filled = [], [0] * world
    for s, owner in zip(slots, owners, strict=True):
        offsets.append(filled[owner])
        filled[owner] += math.prod(s.shape)
    width = max(filled)
    device = slots[0].value.device
    send = torch.empty(width, dtype=dtype, device=device)
    where = {id(s): (off, s.shape) for s, off in zip(slots, offsets, strict=True)}

    def into_send(slot: MatrixSlot, direction: Tensor) -> None:
        off, shape = where[id(slot)]
        send[off : off + math.prod(shape)].view(shape).copy_(direction)

    mine = [(s, t) for s, t, o in zip(slots, thunks, owners, strict=True) if o == rank]
    compute(mine, into_send)
    received = torch.empty(world * width, dtype=dtype, device=device)
    _all_gather_single(received, send, group=group)
    for s, owner, off in zip(slots, owners, offsets, strict=True):
        start = owner * width + off
        apply(s, received[start : start + math.prod(s.shape)].view(s.shape))


def exchange_row_sharded(
    slots: Sequence[MatrixSlot],
    local_m_tildes: Sequence[Callable[[], Tensor]],
    compute: Compute,
    apply: Sink,
    *,
    costs: Sequence[float],
    dtype: torch.dtype,
    mesh_dim: int,
) -> None:
    """FSDP2: gather whole ``M̃`` matrices on their owners, scatter the directions' rows back.

    ``local_m_tildes[i]()`` gives this rank's rows of slot ``i``'s ``M̃`` (any shape with the
    rows first) and ``costs[i]`` its FLOPs. ``apply`` receives this rank's rows of each
    direction, shaped ``(rows, n)``. All slots share one device mesh; ``mesh_dim`` is the
    dimension they are sharded along.
    """
    mesh = slots[0].param.device_mesh
    group, world = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    owners = balance(costs, world)
    # sizes[i][r]: elements of slot i held by rank r
    sizes = []
    for s in slots:
        layout = shard_rows(s.shape[0], world)
        if s.value.shape[0] != layout[rank][1]:
            raise NotImplementedError(
                f"a row-sharded parameter of shape {tuple(s.param.shape)} holds "
                f"{s.value.shape[0]} rows on rank {rank}, expected {layout[rank][1]} "
                "(torch.chunk's even split, as fully_shard makes it)"
            )
        sizes.append([length * s.shape[1] for _, length in layout])
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    device = slots[0].value.device

    # 1) every rank's rows of M̃ go to the owner; buffers are grouped by peer rank, slots in
    #    index order within a peer
    send_counts = [sum(sizes[i][rank] for i in range(len(slots)) if owners[i] == dst)
                   for dst in range(world)]
    recv_counts = [sum(sizes[i][src] for i in mine) for src in range(world)]
    send_at, recv_at = _offsets(sizes, owners, rank, world)
    carrier = slots[0].grad.dtype
    for s in slots:
        carrier = torch.promote_types(torch.promote_types(carrier, s.grad.dtype), s.momentum.dtype)
    send = torch.empty(sum(send_counts), dtype=carrier, device=device)
    for i, thunk in enumerate(local_m_tildes):
        start = send_at[i]
        send[start : start + sizes[i][rank]].copy_(thunk().reshape(-1))
    received = torch.empty(sum(recv_counts), dtype=carrier, device=device)
    dist.all_to_all_single(received, send, recv_counts, send_counts, group=group)
    del send

    # 2) the owner assembles whole matrices (rows in rank order) and computes the directions;
    #    each direction's rows go back to their ranks at the mirrored offsets
    def whole(i: int) -> Callable[[], Tensor]:
        def assemble() -> Tensor:
            parts = [received[recv_at[i][src] : recv_at[i][src] + sizes[i][src]]
                     for src in range(world)]
            return torch.cat(parts).view(slots[i].shape)
        return assemble

    back = torch.empty(sum(recv_counts), dtype=dtype, device=device)
    index = {id(slots[i]): i for i in mine}

    def into_back(slot: MatrixSlot, direction: Tensor) -> None:
        i = index[id(slot)]
        first = 0
        for src in range(world):
            length = sizes[i][src] // slot.shape[1]
            piece = back[recv_at[i][src] : recv_at[i][src] + sizes[i][src]]
            piece.view(length, slot.shape[1]).copy_(direction[first : first + length])
            first += length

    compute([(slots[i], whole(i)) for i in mine], into_back)

    # 3) every rank receives its rows of every direction, grouped by owner
    directions = torch.empty(sum(send_counts), dtype=dtype, device=device)
    dist.all_to_all_single(directions, back, send_counts, recv_counts, group=group)
    for i, s in enumerate(slots):
        start, size = send_at[i], sizes[i][rank]
        apply(s, directions[start : start + size].view(size // s.shape[1], s.shape[1]))


def _offsets(sizes, owners, rank, world):
    """Where each slot's piece sits in the send buffer (this rank's rows, grouped by owner)
    and in the receive buffer (every rank's rows of the slots this rank owns, by source)."""
    send_at, cursor = {}, 0
    for dst in range(world):
        for i, owner in enumerate(owners):
            if owner == dst:
                send_at[i] = cursor
                cursor += sizes[i][rank]
    recv_at, cursor = {}, 0
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    for i in mine:
        recv_at[i] = {}
    for src in range(world):
        for i in mine:
            recv_at[i][src] = cursor
            cursor += sizes[i][src]
    return send_at, recv_at


def full_tensor(like: Tensor, local_part: Tensor) -> Tensor:
    """The whole tensor whose local shard is ``local_part``, laid out like the DTensor ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_part, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    ).full_tensor()


def local_part(like: Tensor, whole: Tensor) -> Tensor:
    """This rank's shard of ``whole``, laid out like the DTensor ``like`` (rows under
    ``Shard(0)``)."""
    dim = row_shard_dim(like)
    if dim is None:
        return whole
    mesh = like.device_mesh
    start, length = shard_rows(whole.shape[0], mesh.size(dim))[mesh.get_local_rank(dim)]
    return whole[start : start + length]
