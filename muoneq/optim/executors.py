"""Where each direction is computed when this process does not compute them all: executors
per layout, moving data only.

The optimizer (:class:`~muoneq.optim.hybrid.HybridOrthogonalOptimizer`) steps a group on one
process itself (:mod:`muoneq.optim.engine`: the planned stacks, or one matrix at a time). The
other layouts go through an executor, which moves data around a
:class:`~muoneq.optim.engine.GroupUpdate` (the group's settings and direction rule) and hands
the matrices this rank owns to :func:`muoneq.optim.engine.directions`, never to the optimizer:

* :func:`split_replicated` — replicated parameters under DDP: every matrix has one owner rank,
  balanced by FLOPs (:func:`balance`), and one ``all_gather`` gives every rank every
  direction;
* :func:`gather_row_shards` — row-sharded ``DTensor`` parameters (FSDP2's ``fully_shard``):
  one ``all_to_all`` sends each rank's rows of ``M̃`` to the matrix's owner, a second one
  returns each rank its rows of the direction (the scheme of microsoft/dion);
* :func:`gather_whole` — row-sharded parameters of methods with state of their own: every
  rank gathers whole matrices, computes every direction and keeps its rows.

Every executor moves parameters in their stored layout and hands
:func:`~muoneq.optim.engine.directions` whole stored tensors; it alone cuts them into the matrices
the method sees and writes the directions back in the stored layout
(:class:`muoneq.layout.MatrixLayout`: transposed storage, expert banks, fused blocks), so each
layout is right in every execution path.

Newton–Schulz costs ``K·(4m²n + 2m³)`` FLOPs per m×n matrix (m ≤ n; see
:func:`muoneq.newton_schulz.ns_flops`) and DiagPre needs the whole matrix (column sums span
every row), hence owners. We write these exchanges by hand because torch offers no collective
that routes whole matrices of a parameter list to chosen ranks; they use only
``torch.distributed`` collectives that both gloo and NCCL implement.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from muoneq.optim.engine import GroupUpdate, MatrixSlot, directions, is_dtensor, local

#: ``all_gather_single`` (torch ≥ 2.14) is the new name of ``all_gather_into_tensor``.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: Largest stack (elements) of same-shape matrices orthogonalized in one batched call.
STACK_ELEMENTS = 1 << 26


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


def row_offset(p: Tensor) -> int:
    """The first stored row of ``p`` this rank holds: 0 unless ``p`` is row-sharded."""
    dim = row_shard_dim(p)
    if dim is None:
        return 0
    mesh = p.device_mesh
    return shard_rows(p.shape[0], mesh.size(dim))[mesh.get_local_rank(dim)][0]


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


def split_replicated(slots: Sequence[MatrixSlot], update: GroupUpdate, group,
                     costs: Sequence[float]) -> None:
    """DDP: each rank computes the directions it owns (``costs``: each slot's FLOPs), then all
    ranks receive all of them (gradients must be the same on every rank:
    :func:`check_same_gradients`)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    owners = balance(costs, world)
    offsets, filled = [], [0] * world
    for s, owner in zip(slots, owners, strict=True):
        offsets.append(filled[owner])
        filled[owner] += s.value.numel()
    width = max(filled)
    device, dtype = slots[0].value.device, update.dtype
    send = torch.empty(width, dtype=dtype, device=device)
    where = {id(s): (off, s.value.shape) for s, off in zip(slots, offsets, strict=True)}

    def into_send(slot: MatrixSlot, direction: Tensor) -> None:
        off, shape = where[id(slot)]
        send[off : off + math.prod(shape)].view(shape).copy_(direction)

    mine = [(s, update.whole_m_tilde(s)) for s, o in zip(slots, owners, strict=True)
            if o == rank]
    directions(mine, update.rule, into_send)
    received = torch.empty(world * width, dtype=dtype, device=device)
    _all_gather_single(received, send, group=group)
    for s, owner, off in zip(slots, owners, offsets, strict=True):
        start = owner * width + off
        update.apply(s, received[start : start + s.value.numel()].view(s.value.shape))


def gather_row_shards(slots: Sequence[MatrixSlot], update: GroupUpdate, mesh_dim: int,
                      costs: Sequence[float]) -> None:
    """FSDP2: gather whole ``M̃`` matrices on their owners, scatter the directions' rows back.

    Rows are those of the stored tensor (a transposed weight's inputs, an expert bank's
    experts): the owner assembles the whole stored tensor, so the layout's blocks are cut from
    whole matrices whatever the sharding. ``update.apply`` receives this rank's rows of each
    direction, shaped ``(rows, width)``. All slots share one device mesh; ``mesh_dim`` is the
    dimension they are sharded along; ``costs`` are each slot's FLOPs.
    """
    mesh = slots[0].param.device_mesh
    group, world = mesh.get_group(mesh_dim), mesh.size(mesh_dim)
    rank = mesh.get_local_rank(mesh_dim)
    owners = balance(costs, world)
    # sizes[i][r]: elements of slot i held by rank r; widths[i]: elements per stored row
    sizes, widths = [], []
    for s in slots:
        stored = s.layout.stored
        layout = shard_rows(stored[0], world)
        if s.value.shape[0] != layout[rank][1]:
            raise NotImplementedError(
                f"a row-sharded parameter of shape {tuple(s.param.shape)} holds "
                f"{s.value.shape[0]} rows on rank {rank}, expected {layout[rank][1]} "
                "(torch.chunk's even split, as fully_shard makes it)"
            )
        widths.append(math.prod(stored[1:]))
        sizes.append([length * widths[-1] for _, length in layout])
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
    for i, slot in enumerate(slots):
        start = send_at[i]
        send[start : start + sizes[i][rank]].copy_(update.m_tilde(slot).reshape(-1))
    received = torch.empty(sum(recv_counts), dtype=carrier, device=device)
    dist.all_to_all_single(received, send, recv_counts, send_counts, group=group)
    del send

    # 2) the owner assembles whole matrices (rows in rank order) and computes the directions;
    #    each direction's rows go back to their ranks at the mirrored offsets
    def whole(i: int) -> Callable[[], Tensor]:
        def assemble() -> Tensor:
            parts = [received[recv_at[i][src] : recv_at[i][src] + sizes[i][src]]
                     for src in range(world)]
            return torch.cat(parts).view(slots[i].layout.stored)
        return assemble

    back = torch.empty(sum(recv_counts), dtype=update.dtype, device=device)
    index = {id(slots[i]): i for i in mine}

    def into_back(slot: MatrixSlot, direction: Tensor) -> None:
        i = index[id(slot)]
        rows, first = direction.reshape(-1, widths[i]), 0
        for src in range(world):
            length = sizes[i][src] // widths[i]
            piece = back[recv_at[i][src] : recv_at[i][src] + sizes[i][src]]
            piece.view(length, widths[i]).copy_(rows[first : first + length])
            first += length

    directions([(slots[i], whole(i)) for i in mine], update.rule, into_back)

    # 3) every rank receives its rows of every direction, grouped by owner
    mine_rows = torch.empty(sum(send_counts), dtype=update.dtype, device=device)
    dist.all_to_all_single(mine_rows, back, send_counts, recv_counts, group=group)
    for i, s in enumerate(slots):
        start, size = send_at[i], sizes[i][rank]
        update.apply(s, mine_rows[start : start + size].view(size // widths[i], widths[i]),
                     row_offset(s.param))


def gather_whole(slots: Sequence[MatrixSlot], update: GroupUpdate) -> None:
    """FSDP2, a method with state of its own: every rank computes every direction from whole
    matrices (the parameter with its gradient, ``M̃`` and the state), then keeps its rows.
    Such methods keep one state per parameter, so their layouts have one block."""
    for s in slots:
        p = s.param
        whole_p = p.full_tensor()
        whole_p.grad = p.grad.full_tensor()
        (m_tilde,) = s.layout.matrices(full_tensor(p, update.m_tilde(s)))
        state = update.rule.state(p)
        whole_state = {k: v.full_tensor() if is_dtensor(v) else v for k, v in state.items()}
        direction = update.rule.direction(whole_p, m_tilde, whole_state)
        for k, v in whole_state.items():
            if is_dtensor(state.get(k)):
                local(state[k]).copy_(local_part(state[k], v))
            else:
                state[k] = v
        update.apply(s, local_part(p, s.layout.stored_view(direction)), row_offset(p))


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
    if row_shard_dim(like) is None:
        return whole
    start = row_offset(like)
    return whole[start : start + local(like).shape[0]]
