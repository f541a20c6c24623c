"""A loader's epochs, map-style or streamed: what training and evaluation ask of their data.

Map-style data (:class:`SampledEpochs`) is split over the ranks by a
distributed sampler and has a global order: a position in it says where an
epoch resumes, a global batch deals it out step by step, and evaluation
results come back in it (:func:`~ddpkit.gather_in_order`). A stream
(:class:`StreamedEpochs`, a :class:`~ddpkit.StreamDataLoader`) has none: each
rank reads its part, the items taken are recorded by key, and results come
back in stream order (:func:`~ddpkit.gather_stream_in_order`).
:func:`epoch_source` picks one; the loop and evaluation never ask which.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset, default_collate

from ddpkit.collectives import all_gather_object
from ddpkit.loaders import build_loader_sampler, distributed_sampler_of, stream_loader
from ddpkit.ordered import gather_each_in_order, gather_each_stream_in_order
from ddpkit.process_group import get_rank, get_world_size
from ddpkit.samplers import DistributedSamplerWrapper
from ddpkit.streams import StreamBatch, StreamDataLoader, StreamProgress, is_stream

__all__ = ["EpochSource", "SampledEpochs", "StreamedEpochs", "epoch_source", "sharded_for_evaluation"]

Tensors = tuple[torch.Tensor, ...]


class EpochSource(Protocol):
    """One split's data, epoch by epoch, as this rank reads it (:class:`SampledEpochs` or :class:`StreamedEpochs`)."""

    #: Positions of the epoch's order that one loader batch holds (1 for a stream or a batch sampler).
    entries_per_batch: int

    #: Items in every loader batch when known ahead (an item sampler's batch size), else ``None``.
    items_per_batch: int | None

    def deal_every_item(self, needed_by: str) -> DistributedSamplerWrapper:
        """Make the sampler deal every item out once per epoch (no padding, no dropping) for ``needed_by``
        (a global batch), and return it.

        Raises:
            ValueError: the data has no global order (a stream), or its loader drops its last batch.
            TypeError: its sampler is not ddpkit's :class:`~ddpkit.DistributedSamplerWrapper`.
        """

    def whole_order(self, needed_by: str) -> DistributedSamplerWrapper:
        """A new sampler of each epoch's whole global order (one replica, every item once, no padding), built
        beside the training sampler from what it wraps, its shuffle and its seed, for ``needed_by`` (a driver
        that deals each step's items itself); the training sampler is left as it is.

        Raises:
            ValueError: the data has no global order (a stream), or its loader drops its last batch.
            TypeError: its sampler is not ddpkit's :class:`~ddpkit.DistributedSamplerWrapper`.
        """

    def seek(self, position: int) -> None:
        """Start the next epoch after ``position`` entries of its global order (0: at its beginning)."""

    def batch_count(self) -> int | None:
        """This rank's batches in an epoch (``None`` when not known ahead: a stream)."""

    def entry_count(self) -> int | None:
        """Entries in an epoch's global order, when known."""

    def training_batches(self) -> Iterator[tuple[Any, float, bool]]:
        """The epoch's batches on this rank as ``(batch, weight, last)``: ``weight`` multiplies the batch's loss
        (0 for padding that must not count), ``last`` marks a last batch that ends a step although no plan
        said so (a stream's, every rank's at the same index)."""

    def taken(self) -> list[Any] | None:
        """What every rank has taken of this epoch when it is not a position (a stream's items; every rank
        calls it), else ``None``."""

    def skip(self, taken: list[Any] | None) -> None:
        """Leave out of the next epoch what :meth:`taken` returned."""

    def evaluation_batches(self) -> Iterator[StreamBatch]:
        """This rank's part of the split, each item once (no padding in a stream), with the keys that order it."""

    def first_batch(self) -> Any:
        """The split's first item, collated as a batch (the shapes a rank with an empty part still needs)."""

    def gather_in_order(self, values: Tensors, keys: torch.Tensor) -> Tensors:
        """Every rank's ``values`` (one row per item of :meth:`evaluation_batches`) in the split's order, each
        item once (every rank calls it)."""


def epoch_source(loader: DataLoader[Any], sampler: DistributedSampler[Any] | None = None) -> EpochSource:
    """``loader``'s epochs: a stream's, or a map-style loader's through ``sampler`` (default: its own
    distributed sampler, or an unpadded one it is rebuilt with, :func:`sharded_for_evaluation`)."""
    if is_stream(loader):
        return StreamedEpochs(stream_loader(loader))
    if sampler is None:
        loader, sampler = sharded_for_evaluation(loader)
    return SampledEpochs(loader, sampler)


def sharded_for_evaluation(loader: DataLoader[Any]) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
    """``loader`` and its distributed sampler; a loader without one is rebuilt with unpadded shards."""
    sampler = distributed_sampler_of(loader)
    if sampler is not None:
        return loader, sampler
    return build_loader_sampler(loader, False, get_world_size(), get_rank(), even_shards=False)


class SampledEpochs:
    """A map-style loader's epochs, split by its distributed ``sampler`` (the batch sampler, or the sampler)."""

    def __init__(self, loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> None:
        self.loader, self.sampler = loader, sampler
        batch_sampler = isinstance(loader.batch_sampler, DistributedSampler) or loader.batch_size is None
        #: Sampler entries per loader batch: 1 for a batch sampler, the batch size for an item sampler.
        self.entries_per_batch = 1 if batch_sampler else int(loader.batch_size or 1)
        #: An item sampler's batch size; ``None`` for a batch sampler, whose batches may differ.
        self.items_per_batch = None if batch_sampler else self.entries_per_batch

    def wrapper(self, needed_by: str) -> DistributedSamplerWrapper:
        """The sampler, which ``needed_by`` needs to be ddpkit's.

        Raises:
            TypeError: it is another (a ``DistributedSampler`` of the user's).
        """
        if not isinstance(self.sampler, DistributedSamplerWrapper):
            raise TypeError(
                f"{needed_by} needs ddpkit's DistributedSamplerWrapper to shard the training data; the training "
                f"loader has a {type(self.sampler).__name__}: give TrainLoop the unsharded loader"
            )
        return self.sampler

    def deal_every_item(self, needed_by: str) -> DistributedSamplerWrapper:
        wrapper = self.wrapper(needed_by)
        self._refuse_drop_last(needed_by)
        wrapper.drop_last, wrapper.even_shards = False, False
        return wrapper

    def whole_order(self, needed_by: str) -> DistributedSamplerWrapper:
        trained = self.wrapper(needed_by)
        self._refuse_drop_last(needed_by)
        return DistributedSamplerWrapper(
            trained.sampler, num_replicas=1, rank=0, shuffle=trained.shuffle, seed=trained.seed, drop_last=False,
            even_shards=False, check_order=trained.check_order,
        )  # fmt: skip

    def _refuse_drop_last(self, needed_by: str) -> None:
        if self.loader.drop_last:
            raise ValueError(
                f"{needed_by} uses every training item once per epoch: build the training DataLoader with "
                "drop_last=False"
            )

    def seek(self, position: int) -> None:
        if position:
            self.wrapper("resuming part-way through an epoch").set_position(position)

    def batch_count(self) -> int:
        return len(self.loader)

    def entry_count(self) -> int | None:
        return self.sampler.entry_count if isinstance(self.sampler, DistributedSamplerWrapper) else None

    def training_batches(self) -> Iterator[tuple[Any, float, bool]]:
        return ((batch, 1.0, False) for batch in self.loader)

    def taken(self) -> None:
        return None  # the position says it

    def skip(self, taken: list[Any] | None) -> None:
        """Nothing: :meth:`seek` places a map-style epoch."""

    def evaluation_batches(self) -> Iterator[StreamBatch]:
        return (StreamBatch(batch, _NO_KEYS) for batch in self.loader)

    def first_batch(self) -> Any:
        return first_item_batch(self.loader)

    def gather_in_order(self, values: Tensors, keys: torch.Tensor) -> Tensors:
        return tuple(gather_each_in_order(values, self.sampler))


class StreamedEpochs:
    """A stream's epochs (``loader``: its :class:`~ddpkit.StreamDataLoader`)."""

    entries_per_batch: int = 1
    items_per_batch: int | None = None

    def __init__(self, loader: StreamDataLoader) -> None:
        self.loader = loader

    def deal_every_item(self, needed_by: str) -> DistributedSamplerWrapper:
        raise ValueError(
            f"{needed_by} needs a training set with a global order (a map-style dataset); a stream has none. Use "
            "grad_accumulation with a stream"
        )

    def whole_order(self, needed_by: str) -> DistributedSamplerWrapper:
        return self.deal_every_item(needed_by)

    def seek(self, position: int) -> None:
        """Nothing: a resumed epoch's items taken are skipped by the stream itself (:meth:`skip`)."""

    def batch_count(self) -> None:
        return None

    def entry_count(self) -> None:
        return None

    def training_batches(self) -> Iterator[tuple[Any, float, bool]]:
        join = self.loader.ends == "join"
        tagged = self.loader.iter_tagged("even" if join else None, count=False)
        ahead = next(tagged, None)
        while ahead is not None:
            current, ahead = ahead, next(tagged, None)
            if not current.padding:  # taken when used (a checkpoint after this step skips it), not when read
                self.loader.progress.add(current.keys)
            yield current.batch, 0.0 if join and current.padding else 1.0, ahead is None

    def taken(self) -> list[Any]:
        return StreamProgress.merged(all_gather_object(self.loader.progress.state()))

    def skip(self, taken: list[Any] | None) -> None:
        if taken:
            self.loader.resume(taken)

    def evaluation_batches(self) -> Iterator[StreamBatch]:
        return self.loader.iter_tagged("join")

    def first_batch(self) -> Any:
        collate = self.loader.collate_fn.collate_fn or default_collate  # type: ignore[union-attr]
        return collate([next(iter(self.loader.stream.dataset))])

    def gather_in_order(self, values: Tensors, keys: torch.Tensor) -> Tensors:
        return tuple(gather_each_stream_in_order(values, keys))


_NO_KEYS = torch.zeros(0, 3, dtype=torch.int64)

#: Each loader's first items as a batch, once loaded (:func:`first_item_batch`).
_FIRST_ITEMS: weakref.WeakKeyDictionary[DataLoader[Any], Any] = weakref.WeakKeyDictionary()


def first_item_batch(loader: DataLoader[Any]) -> Any:
    """A batch of ``loader``'s dataset's first items (as many as its batch size: the shapes of its batches, and
    BatchNorm needs more than one), loaded as ``loader`` loads its batches: by a worker of its own kind when it has
    workers (its ``worker_init_fn`` and multiprocessing context), through its ``collate_fn`` and pinning; loaded
    once for the loader's life (what a rank with no batch left runs, whose result counts nothing)."""
    if loader not in _FIRST_ITEMS:
        batch = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None) or 1
        workers, size = min(1, loader.num_workers), max(1, min(batch, len(loader.dataset)))  # type: ignore[arg-type]
        one = DataLoader(
            Subset(loader.dataset, range(size)), batch_size=size, collate_fn=loader.collate_fn, num_workers=workers,
            pin_memory=loader.pin_memory, pin_memory_device=loader.pin_memory_device, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context if workers
            else None,
        )  # fmt: skip
        _FIRST_ITEMS[loader] = next(iter(one))
    return _FIRST_ITEMS[loader]
