"""Which of a rank's loader batches end an optimizer step, and what each batch's loss is divided by.

``TrainLoop`` steps one of two ways:

* :class:`Accumulation` (``grad_accumulation=k``, default 1, as every peer
  does): each rank steps after every ``k`` of its batches and after its last,
  each batch's loss divided by ``k``. A step then holds ``W * batch * k``
  items: the global batch changes with the world size ``W``.
* :class:`GlobalBatch` (``global_batch_size=G``): a step holds ``G`` items of
  the epoch's global order, whatever the world size. The sampler deals entry
  position ``p`` to rank ``p % W``, so with ``k = G / (W * batch)`` each
  rank's batches ``s*k ... s*k + k - 1`` hold exactly the positions of step
  ``s``, and a run resized between two steps goes on with the same steps. The
  epoch's last step holds what is left, and a rank may have fewer of its
  batches in it than another, or none: that step's gradients are averaged by
  one explicit all-reduce instead of DDP's, and each batch's loss (a mean over
  its items) is divided by ``step items / (batch items * W)``, so every
  step's gradient is the mean over its items, as one process with a batch of
  ``G`` items computes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ddpkit._gradients import reduce_gradients
from ddpkit.process_group import get_world_size, is_distributed
from ddpkit.samplers import DistributedSamplerWrapper, EpochLayout
from ddpkit.training._deal import batch_seed, first_position, step_divisor
from ddpkit.training._sources import EpochSource

__all__ = ["Accumulation", "GlobalBatch", "GlobalSteps", "StepPlan", "TrainingEpochs", "average_gradients"]


class StepPlan(Protocol):
    """How one rank's batches of one epoch make optimizer steps (:class:`Accumulation` or :class:`GlobalSteps`).

    ``index`` counts this rank's batches of the epoch from where it (re)started.
    """

    @property
    def final_step(self) -> bool:
        """Whether a step is left after this rank's last batch: one that not every rank had a batch in, whose
        gradients :func:`average_gradients` synchronises before it is taken."""

    def ends_step(self, index: int) -> bool:
        """Whether batch ``index`` ends an optimizer step through DDP's all-reduce."""

    def divisor(self, index: int) -> float:
        """What batch ``index``'s loss is divided by."""

    def position_after(self, index: int) -> int:
        """Entries of the epoch's global order done once the step of batch ``index`` is done."""

    def batch_seed(self, index: int) -> int | None:
        """The seed torch's RNG gets before batch ``index``, or ``None`` to run on."""

    def end_position(self) -> int:
        """Entries of the epoch's global order done once the final step is done."""

    def in_final_step(self, index: int) -> bool:
        """Whether batch ``index`` belongs to the final step."""

    def final_batches(self) -> int:
        """The most batches any rank has in the final step (0 without one)."""


@dataclass(frozen=True)
class Accumulation:
    """Steps of ``accumulation`` batches per rank (the last step of the epoch may hold fewer).

    Attributes:
        accumulation: batches per optimizer step on each rank.
        batches: this rank's batches in the epoch (from ``start`` on); ``None`` for a stream.
        start: the entry position the epoch resumed at (0 at its beginning).
        entries_per_round: entries all ranks' ``i``-th batches hold together
            (``W`` times the entries of one batch).
        entry_count: entries in the epoch, when known (positions stop there).
    """

    accumulation: int
    batches: int | None
    start: int = 0
    entries_per_round: int = 1
    entry_count: int | None = None
    #: Whether a step is left after the last batch (never: each rank steps after its last batch).
    final_step: bool = field(default=False, init=False)

    @property
    def offset(self) -> int:
        """Batches each rank did before ``start``."""
        return self.start // self.entries_per_round

    def ends_step(self, index: int) -> bool:
        """Whether this rank's batch ``index`` (counted from ``start``) ends an optimizer step (a stream's last
        batch, whose count is not known ahead, ends one too: the source's ``training_batches`` says which)."""
        return (self.offset + index + 1) % self.accumulation == 0 or index + 1 == self.batches

    def divisor(self, index: int) -> int:
        """What batch ``index``'s loss is divided by: ``accumulation``."""
        return self.accumulation

    def position_after(self, index: int) -> int:
        """Entries of the epoch's global order done once every rank's batch ``index`` is done."""
        position = self.start + (index + 1) * self.entries_per_round
        return position if self.entry_count is None else min(position, self.entry_count)

    def batch_seed(self, index: int) -> int | None:
        """``None``: the random state runs on from the previous batch."""
        return None

    def end_position(self) -> int:
        """Never asked: there is no final step."""
        raise AssertionError("Accumulation has no final step")

    def in_final_step(self, index: int) -> bool:
        """Never: there is no final step."""
        return False

    def final_batches(self) -> int:
        """0: there is no final step."""
        return 0


@dataclass(frozen=True)
class GlobalBatch:
    """A fixed number of items per optimizer step, over all ranks (``TrainLoop(global_batch_size=...)``)."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"global_batch_size={self.size!r} must be an integer >= 1 (items per optimizer step)")

    @classmethod
    def of(cls, size: int | None, fault_tolerant: bool) -> GlobalBatch | None:
        """``TrainLoop``'s ``global_batch_size=size`` (``None``: none), which a ``fault_tolerant`` run needs.

        Raises:
            ValueError: ``size`` is not an integer >= 1, or is ``None`` in a fault-tolerant run.
        """
        if size is None and fault_tolerant:
            raise ValueError(
                "fault_tolerance needs global_batch_size (items per optimizer step over all replica groups): each "
                "step's items are dealt over the groups of that step's quorum, whose number changes"
            )
        return cls(size) if size is not None else None

    def check_no_accumulation(self, grad_accumulation: int) -> None:
        """Raise ``ValueError`` for a ``grad_accumulation`` besides the global batch (which sets it)."""
        if grad_accumulation != 1:
            raise ValueError(
                f"grad_accumulation={grad_accumulation} and global_batch_size={self.size}: pass one; with "
                "global_batch_size each world size derives its accumulation"
            )

    def accumulation(self, world_size: int, batch_items: int) -> int:
        """Batches per step on each of ``world_size`` ranks whose batches hold ``batch_items`` items.

        Raises:
            ValueError: ``world_size * batch_items`` does not divide the global
                batch; the message lists the world sizes that can reach it.
        """
        if self.size % (world_size * batch_items) == 0:
            return self.size // (world_size * batch_items)
        fits = [w for w in range(1, self.size // batch_items + 1) if self.size % (w * batch_items) == 0]
        can = (
            f"with these batches it runs on {', '.join(map(str, fits))} rank(s)"
            if fits
            else f"no world size can: make it a multiple of {batch_items}"
        )
        raise ValueError(
            f"global_batch_size={self.size} cannot be reached on {world_size} rank(s) with batches of {batch_items} "
            f"items (each step needs the same whole number of batches on every rank): {can}. Otherwise change the "
            "training loader's batch size or global_batch_size"
        )

    def epoch(self, layout: EpochLayout, rank: int, entries_per_batch: int, seed: int, epoch: int) -> GlobalSteps:
        """The steps of the epoch ``layout`` deals out, seen from ``rank`` whose batches hold ``entries_per_batch``
        entries; batch seeds hash ``seed``, ``epoch`` and the batch's first position.

        Raises:
            ValueError: this world size cannot reach the global batch (:meth:`accumulation`),
                or the layout pads or drops its tail.
        """
        if layout.tail != "uneven":
            raise ValueError(
                f"a global batch needs an epoch dealt out without padding or dropping (not {layout.tail!r})"
            )
        sizes = layout.batch_sizes
        entry_items = int(sizes.max()) if sizes is not None and len(sizes) else 1
        accumulation = self.accumulation(layout.world_size, entries_per_batch * entry_items)
        return GlobalSteps(layout, rank, entries_per_batch, accumulation, self.size // entry_items, seed, epoch)


class GlobalSteps:
    """One rank's view of one epoch's steps of a :class:`GlobalBatch` (see the module docstring)."""

    def __init__(
        self, layout: EpochLayout, rank: int, entries_per_batch: int, accumulation: int, entries_per_step: int,
        seed: int, epoch: int,
    ) -> None:  # fmt: skip
        self.layout, self.rank, self.entries_per_batch = layout, rank, entries_per_batch
        self.accumulation, self.entries_per_step = accumulation, entries_per_step
        self.seed, self.epoch = seed, epoch
        self.start, self.end = min(layout.start, layout.entry_count), layout.entry_count
        left = self.end - self.start
        self.full_steps = left // entries_per_step
        #: Whether the epoch's last step is left after this rank's last batch (it holds fewer than the global
        #: batch, so not every rank has a batch in it: it is synchronised explicitly, :func:`average_gradients`).
        self.final_step = self.full_steps < math.ceil(left / entries_per_step)
        chunks = torch.split(layout.rank_entry_items(rank), entries_per_batch)
        self._batch_items = [int(chunk.sum()) for chunk in chunks]
        self._step_items: dict[int, int] = {}

    def ends_step(self, index: int) -> bool:
        """Whether batch ``index`` ends a step through DDP's all-reduce (never in a last, smaller step)."""
        return (index + 1) % self.accumulation == 0 and index // self.accumulation < self.full_steps

    def divisor(self, index: int) -> float:
        """``step items / (batch items * W)``: ``accumulation`` in a step of the full global batch."""
        return step_divisor(self._items_of_step(index // self.accumulation), self._batch_items[index],
                            self.layout.world_size)  # fmt: skip

    def position_after(self, index: int) -> int:
        """Entries of the epoch's global order done once the step of batch ``index`` is done."""
        return min(self.end, self.start + (index // self.accumulation + 1) * self.entries_per_step)

    def batch_seed(self, index: int) -> int:
        """The seed of batch ``index``'s random numbers (dropout): a hash of the seed, the epoch and the
        batch's first position, so that a restarted run draws what the first one drew."""
        first = first_position(self.start, self.layout.world_size, self.rank, index, self.entries_per_batch)
        return batch_seed(self.seed, self.epoch, first)

    def end_position(self) -> int:
        """The epoch's entry count: the final step ends it."""
        return self.end

    def in_final_step(self, index: int) -> bool:
        """Whether batch ``index`` comes after the full steps."""
        return self.final_step and index // self.accumulation >= self.full_steps

    def final_batches(self) -> int:
        """The most batches any rank has in the final step (0 without one)."""
        if not self.final_step:
            return 0
        full = self.full_steps * self.accumulation
        ranks = range(self.layout.world_size)
        return max(math.ceil(self.layout.shard_length(r) / self.entries_per_batch) - full for r in ranks)

    def _items_of_step(self, step: int) -> int:
        if step not in self._step_items:
            low = self.start + step * self.entries_per_step
            self._step_items[step] = self.layout.items_between(low, min(self.end, low + self.entries_per_step))
        return self._step_items[step]


def average_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """All-reduce the gradients of ``parameters`` to their mean over the ranks, as DDP does (every rank calls it).

    A parameter without a gradient counts as a zero gradient (and gets one), so
    ranks that had no batch in a step take part. Gradients are divided by the
    world size before the sum, as DDP's default hook does; one ``all_reduce``
    per device and dtype. Without a process group nothing happens.
    """
    if not is_distributed():
        return
    world_size = get_world_size()

    def mean(flat: torch.Tensor) -> bool:
        dist.all_reduce(flat.div_(world_size))
        return True

    reduce_gradients(parameters, mean)


class TrainingEpochs:
    """The training loader's epochs as optimizer steps (what ``TrainLoop`` asks of its training data).

    Args:
        source: the training loader's epochs (:func:`~ddpkit.training._sources.epoch_source`), sharded.
        global_batch: the fixed global batch, or ``None`` to accumulate.
        world_size: the number of ranks.

    With a global batch the sampler deals every item out once (no padding, no
    dropping), and when the batches' items are known ahead the world size is
    checked at once. A stream has no global order: its positions count the
    batches all ranks took.

    Raises:
        TypeError: a global batch with a sampler that is not ddpkit's wrapper.
        ValueError: a global batch with ``drop_last=True``, with a stream, or that this world size cannot reach.
    """

    def __init__(self, source: EpochSource, global_batch: GlobalBatch | None, world_size: int) -> None:
        self.source, self.global_batch = source, global_batch
        #: Entries of the global order in one loader batch of a rank.
        self.entries_per_batch = source.entries_per_batch
        #: Entries all ranks' ``i``-th batches hold together.
        self.entries_per_round = source.entries_per_batch * world_size
        #: The sampler that deals a global batch's epochs out.
        self.dealer: DistributedSamplerWrapper | None = None
        if global_batch is not None:
            self.dealer = source.deal_every_item(f"global_batch_size={global_batch.size}")
            if source.items_per_batch is not None:
                global_batch.accumulation(world_size, source.items_per_batch)

    def begin(self, position: int, accumulation: int, seed: int, epoch: int) -> StepPlan:
        """Start epoch ``epoch`` at entry ``position`` (0: its beginning); its steps (a global batch's hash
        ``seed``, the epoch and each batch's position into the batch seeds)."""
        self.source.seek(position)
        if self.dealer is not None:
            return _DealtSteps(self, seed, epoch)
        return Accumulation(
            accumulation, self.source.batch_count(), position, self.entries_per_round, self.source.entry_count()
        )

    def global_steps(self, seed: int, epoch: int) -> GlobalSteps:
        """The global batch's steps of the epoch the sampler has dealt out."""
        assert self.global_batch is not None
        assert self.dealer is not None
        assert self.dealer.last_layout is not None, "begin() first, then iterate the loader"
        return self.global_batch.epoch(self.dealer.last_layout, self.dealer.rank, self.entries_per_batch, seed, epoch)


class _DealtSteps:
    """A global batch's :class:`GlobalSteps`, made when first asked: the sampler deals the epoch out (and
    knows its layout) only once the loader has started iterating."""

    def __init__(self, epochs: TrainingEpochs, seed: int, epoch: int) -> None:
        self._epochs, self._seed, self._epoch = epochs, seed, epoch
        self._steps: GlobalSteps | None = None

    @property
    def steps(self) -> GlobalSteps:
        if self._steps is None:
            self._steps = self._epochs.global_steps(self._seed, self._epoch)
        return self._steps

    @property
    def final_step(self) -> bool:
        return self.steps.final_step

    def ends_step(self, index: int) -> bool:
        return self.steps.ends_step(index)

    def divisor(self, index: int) -> float:
        return self.steps.divisor(index)

    def position_after(self, index: int) -> int:
        return self.steps.position_after(index)

    def batch_seed(self, index: int) -> int | None:
        return self.steps.batch_seed(index)

    def end_position(self) -> int:
        return self.steps.end_position()

    def in_final_step(self, index: int) -> bool:
        return self.steps.in_final_step(index)

    def final_batches(self) -> int:
        return self.steps.final_batches()
