"""How one epoch's entries are dealt out to the ranks, and the way back for ``gather_in_order``.

An *entry* is what the wrapped sampler yields: an index, or a whole batch (a
list of indices) for a batch sampler. Entry position ``p`` of the epoch goes to
rank ``p % W`` (``DistributedSampler``'s layout), after an optional shuffle of
the positions. An epoch resumed at position ``s`` (a run resized part-way
through it, perhaps) deals out only the positions from ``s`` on, position
``s + k`` to rank ``k % W``. The tail, when the ``m = n - s`` entries left do
not divide by ``W``, is the one choice in this module (:data:`Tail`):

* ``"pad"``: positions run up to ``s + ceil(m / W) * W``; the extra ones repeat
  entries from the start (every rank gets ``ceil(m / W)``);
* ``"drop"``: positions stop at ``s + (m // W) * W`` (every rank gets ``m // W``);
* ``"uneven"``: positions stop at ``n``; ranks differ by at most one entry and
  nothing repeats (exact evaluation, and elastic training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["EpochLayout", "Tail", "tail_of"]

Tail = Literal["pad", "drop", "uneven"]


def tail_of(drop_last: bool, even_shards: bool) -> Tail:
    """The tail that ``DistributedSamplerWrapper``'s public arguments choose (``drop_last`` wins)."""
    if drop_last:
        return "drop"
    return "pad" if even_shards else "uneven"


@dataclass(frozen=True)
class EpochLayout:
    """How one epoch was sharded: enough to map every rank's items back to the wrapped order.

    Attributes:
        entry_count: entries (items, or batches) the wrapped sampler produced.
        world_size: number of ranks.
        tail: what happens to the entries past the last full round (:data:`Tail`).
        permutation: the position shuffle (entry at shuffled position ``p`` is
            ``permutation[p]``), or ``None``.
        batch_sizes: items in each entry for a batch sampler (int64,
            ``(entry_count,)``), ``None`` for an item sampler.
        start: the first position dealt out (``0``, or where a resumed epoch
            goes on); the positions before it were used before.
    """

    entry_count: int
    world_size: int
    tail: Tail
    permutation: torch.Tensor | None = None
    batch_sizes: torch.Tensor | None = None
    start: int = 0

    def total_positions(self) -> int:
        """The end of the positions dealt out: padded up, dropped down, or exactly ``entry_count``."""
        n, w, s = self.entry_count, self.world_size, min(self.start, self.entry_count)
        left = n - s
        if self.tail == "pad":
            return s + -(-left // w) * w if n else 0
        if self.tail == "drop":
            return s + left // w * w
        return n

    def shard_length(self, rank: int) -> int:
        """Entries ``rank`` gets: its positions ``start + rank, start + rank + W, ...`` below
        :meth:`total_positions`."""
        return len(self._positions(rank))

    def items_between(self, low: int, high: int) -> int:
        """Items (not entries) at positions ``[low, high)`` of the epoch, the tail's repeats included (counted on the
        host: a training step asks, and reads nothing back from a tensor)."""
        if self.batch_sizes is None:
            return max(0, high - low)
        positions = torch.arange(low, max(low, high), dtype=torch.int64)
        return sum(self._items_of(self._entries_at(positions)).tolist())

    def rank_entry_items(self, rank: int) -> torch.Tensor:
        """Items in each entry ``rank`` gets, in its iteration order (int64; all ones for an item sampler)."""
        return self._items_of(self.entry_indices(rank))

    def entry_indices(self, rank: int) -> torch.Tensor:
        """Indices (into the wrapped order) of the entries ``rank`` gets, in its iteration order (int64)."""
        return self._entries_at(self._positions(rank))

    def rank_items(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, first)`` for each item ``rank`` yields, in order.

        ``positions`` are item positions in the wrapped sampler's flattened order;
        ``first`` is false for the padded repeats (duplicates of earlier positions).
        """
        first = self._positions(rank) < self.entry_count
        indices = self.entry_indices(rank)
        if self.batch_sizes is None:
            return indices, first
        offsets = torch.cumsum(self.batch_sizes, 0) - self.batch_sizes
        sizes = self.batch_sizes[indices]
        starts = torch.repeat_interleave(offsets[indices] - torch.cumsum(sizes, 0) + sizes, sizes)
        items = torch.arange(int(sizes.sum()), dtype=torch.int64) + starts
        return items, torch.repeat_interleave(first, sizes)

    def items(self) -> int:
        """Items (not entries) in the wrapped sampler's epoch."""
        return self.entry_count if self.batch_sizes is None else int(self.batch_sizes.sum())

    def _positions(self, rank: int) -> torch.Tensor:
        """Layout positions ``start + rank, start + rank + W, ...`` below the total (empty when there are fewer)."""
        first = min(self.start, self.entry_count) + rank
        return torch.arange(first, max(first, self.total_positions()), self.world_size, dtype=torch.int64)

    def _entries_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The wrapped order's entry at each position (the tail's repeats wrap to the epoch's start)."""
        if self.entry_count:
            positions = positions % self.entry_count
        return self.permutation[positions] if self.permutation is not None else positions

    def _items_of(self, entries: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(entries) if self.batch_sizes is None else self.batch_sizes[entries]
