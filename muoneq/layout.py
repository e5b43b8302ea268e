"""How the matrix path sees a stored parameter: one or more ``(out, in·…)`` matrices, and back.

Algorithm 1 is stated for an m×n matrix ``X`` that maps ``n`` inputs to ``m`` outputs: DiagPre
"R" scales its rows (one per output neuron) and the shape factor ``a`` of the update reads
``(m, n)``. A parameter as a model stores it is not always that matrix:

* ``nn.Linear`` and convolutions store ``(out, in, k…)``: the matrix is ``(out, in·k…)``
  (the plain layout, :func:`muoneq.functional.matrix_shape`);
* ``transformers``' ``Conv1D`` (GPT-2 and its relatives) stores ``(in, out)``, transposed
  convolutions ``(in, out/groups, k…)``, many MoE expert banks ``(experts, in, out)``:
  ``transposed=True`` swaps the first two (non-batch) dimensions back;
* MoE expert banks stack one matrix per expert along a leading dimension
  (``(experts, out, in)``): ``batch_dims=1`` makes each expert its own matrix;
* fused projections (Q, K and V in one matrix, gate and up in one matrix) hold several
  matrices stacked along ``out``: ``splits=(d_q, d_k, d_v)`` equilibrates and orthogonalizes
  each block on its own, as if the layers were separate.

:class:`MatrixLayout` holds these three choices (the param-group keys ``transposed``,
``batch_dims`` and ``splits`` of every matrix optimizer here) and is the one place that maps
between a stored tensor and its blocks: the plan (:mod:`muoneq.optim.plan`) stages ``M̃`` of a
bank into its chunks' stacks through :meth:`MatrixLayout.stacked_blocks` and writes the
directions back through the same views, and the update (line 13) reaches blocks of several
shapes, and a sharded parameter's rows (:mod:`muoneq.optim.distributed`), through
:meth:`MatrixLayout.pieces`, each block with the shape factor of its own ``(rows, n)``. A block
is therefore updated exactly as the same weights would be as a separate ``nn.Linear``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor


def check_splits(key: str, value, group: dict):
    """``None`` or a non-empty sequence of positive row counts, stored as a tuple."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(
            f"{key}: expected null or a list of positive row counts (the blocks of a fused "
            f"weight along its output dimension), got {value!r}"
        )
    return tuple(value)


@dataclass(frozen=True)
class MatrixLayout:
    """The matrices of one stored parameter of shape ``stored`` (see the module docstring).

    ``batch_dims`` leading dimensions index separate matrices; of the rest, the first is the
    output dimension, or the second when ``transposed``; ``splits`` cut each matrix's rows
    (outputs) into blocks. The default layout is the plain ``(out, in·k…)`` view.
    """

    stored: tuple[int, ...]
    transposed: bool = False
    splits: tuple[int, ...] | None = None
    batch_dims: int = 0

    @classmethod
    def of(cls, p: Tensor, group: dict) -> MatrixLayout:
        """The layout of parameter ``p`` in a param group (keys ``transposed``, ``splits``,
        ``batch_dims``); a ``ValueError`` naming the key when they do not fit ``p``'s shape."""
        layout = cls(tuple(p.shape), bool(group.get("transposed", False)),
                     group.get("splits"), int(group.get("batch_dims", 0)))
        layout.check()
        return layout

    def check(self) -> None:
        shape = tuple(self.stored)
        if len(shape) < 2 + self.batch_dims:
            raise ValueError(
                f"batch_dims: a parameter of shape {shape} with batch_dims={self.batch_dims} "
                "leaves fewer than 2 dimensions for its matrices"
            )
        if self.splits is not None and sum(self.splits) != self.matrix[0]:
            raise ValueError(
                f"splits: {list(self.splits)} must add up to the {self.matrix[0]} outputs of a "
                f"parameter of shape {shape} (its matrix is {self.matrix}"
                f"{', transposed' if self.transposed else ''})"
            )

    # ------------------------------------------------------------------ shapes
    @property
    def plain(self) -> bool:
        """The stored tensor viewed as ``(dim 0, the rest)`` is the one matrix."""
        return not self.transposed and self.splits is None and self.batch_dims == 0

    @property
    def count(self) -> int:
        """Matrices stacked along the batch dimensions (experts)."""
        return math.prod(self.stored[: self.batch_dims])

    @property
    def _core(self) -> tuple[int, ...]:
        """The stored shape of one matrix, dimensions in the order ``(out, in, k…)``."""
        core = self.stored[self.batch_dims :]
        return (core[1], core[0], *core[2:]) if self.transposed else core

    @property
    def matrix(self) -> tuple[int, int]:
        """``(out, in·k…)`` of one whole matrix (before splits)."""
        core = self._core
        return (core[0], math.prod(core[1:]))

    @property
    def rows(self) -> tuple[int, ...]:
        return self.splits or (self.matrix[0],)

    @property
    def blocks(self) -> list[tuple[int, int]]:
        """``(rows, n)`` of every block, experts first, then splits."""
        n = self.matrix[1]
        return [(r, n) for _ in range(self.count) for r in self.rows]

    def _row_ranges(self) -> list[tuple[int, int]]:
        starts = [0, *itertools.accumulate(self.rows)][:-1]
        return list(zip(starts, self.rows, strict=True))

    # ------------------------------------------------------------------ whole tensors
    def _oriented(self, t: Tensor) -> Tensor:
        """A view of the whole stored tensor ``t`` as ``(count, out, in, k…)``."""
        core = self.stored[self.batch_dims :]
        view = t.reshape(self.count, *core)
        return view.transpose(1, 2) if self.transposed else view

    def matrices(self, t: Tensor) -> list[Tensor]:
        """The blocks of the whole stored tensor ``t``, each a contiguous ``(rows, n)`` matrix
        (views of ``t`` where the layout allows, copies otherwise)."""
        if self.plain:
            return [t.reshape(self.matrix)]
        oriented = self._oriented(t)
        n = self.matrix[1]
        return [oriented[b, start : start + rows].reshape(rows, n).contiguous()
                for b in range(self.count) for start, rows in self._row_ranges()]

    @property
    def uniform(self) -> bool:
        """Every block has the same shape (and so the same shape factor ``a``)."""
        return len(set(self.rows)) == 1

    def stacked_blocks(self, bank: Tensor) -> list[Tensor]:
        """The blocks of ``k`` parameters of this layout stacked as ``bank`` (``(k, *stored)``,
        contiguous), as views, one per split: ``(k·count, rows, in, k…)``, outputs first (strided
        when transposed); flattened, each is a stack of ``(rows, n)`` matrices, parameters
        first, then experts."""
        view = bank.view(bank.shape[0] * self.count, *self.stored[self.batch_dims :])
        if self.transposed:
            view = view.transpose(1, 2)
        return [view[:, start : start + rows] for start, rows in self._row_ranges()]

    def stored_view(self, direction: Tensor) -> Tensor:
        """The direction of a one-block layout, ``(out, n)``, as a view in the stored layout."""
        view = direction.reshape(self.count, *self._core)
        if self.transposed:
            view = view.transpose(1, 2)
        return view.reshape(self.stored)

    def put(self, out: Tensor, index: int, direction: Tensor) -> None:
        """Write the direction of block ``index`` (in the order of :attr:`blocks`) into ``out``,
        a whole tensor in the stored layout."""
        ranges = self._row_ranges()
        start, rows = ranges[index % len(ranges)]
        target = self._oriented(out)[index // len(ranges), start : start + rows]
        target.copy_(direction.reshape(target.shape))

    # ------------------------------------------------------------------ a rank's rows
    def pieces(self, t: Tensor, start: int = 0) -> Iterator[tuple[tuple[int, int], Tensor]]:
        """``(block shape, view)`` of the part of every block held by ``t``: rows
        ``start : start + len(t)`` of the stored tensor (the whole of it by default, or a
        row shard), each view with its block's rows first, as ``(rows, in, k…)``."""
        ranges, n = self._row_ranges(), self.matrix[1]
        if self.batch_dims:
            oriented = t.reshape(-1, *self.stored[self.batch_dims :])
            if self.transposed:
                oriented = oriented.transpose(1, 2)
            for b in range(oriented.shape[0]):
                for first, rows in ranges:
                    yield (rows, n), oriented[b, first : first + rows]
        elif self.transposed:
            oriented = t.transpose(0, 1)
            for first, rows in ranges:
                yield (rows, n), oriented[first : first + rows]
        else:
            for first, rows in ranges:
                lo, hi = max(first, start), min(first + rows, start + t.shape[0])
                if lo < hi:
                    yield (rows, n), t[lo - start : hi - start]

    def describe(self) -> str:
        """The matrices as the optimizer sees them, e.g. ``(768, 2304)`` or ``3×(64, 64)``."""
        blocks = self.blocks
        if len(set(blocks)) == 1:
            text = str(blocks[0]) if len(blocks) == 1 else f"{len(blocks)}×{blocks[0]}"
        else:
            text = " + ".join(str(b) for b in blocks[: len(self.rows)])
            text = f"{self.count}×[{text}]" if self.count > 1 else text
        return text
