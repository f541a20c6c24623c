"""Rebuild DataLoaders for DDP without losing anything (OML's and aitoolbox's loader functions).

Peers rebuild a loader from a handful of fields and silently drop the rest
(aitoolbox keeps 9 and loses ``persistent_workers``, ``prefetch_factor``,
``generator``, ``multiprocessing_context``, ``pin_memory_device`` and any custom
sampler). Here every ``DataLoader.__init__`` argument the loader holds is
carried over, and any sampler or batch sampler is sharded by
:class:`~ddpkit.DistributedSamplerWrapper`.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Any

from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ddpkit.errors import WarningDDP
from ddpkit.process_group import ensure_dist_connection
from ddpkit.samplers import DDPSamplerWrapper, DistributedSamplerWrapper
from ddpkit.streams import ShardedStream, StreamDataLoader, StreamEnds, is_stream

__all__ = [
    "build_loader_sampler",
    "check_loaders_is_patched",
    "distributed_sampler_of",
    "extract_loader_parameters",
    "patch_dataloader_to_ddp",
    "stream_loader",
]

log = logging.getLogger(__name__)

_DATA_RELATED = ("sampler", "batch_sampler", "drop_last", "shuffle", "batch_size", "dataset")


def extract_loader_parameters(loader: DataLoader[Any], ignore_data_related_parameters: bool = False) -> dict[str, Any]:
    """The ``DataLoader.__init__`` arguments ``loader`` holds (OML's ``extract_loader_parameters``).

    Every parameter of ``DataLoader.__init__`` that the loader keeps as an
    attribute is returned (``num_workers``, ``collate_fn``, ``pin_memory``,
    ``timeout``, ``worker_init_fn``, ``multiprocessing_context``, ``generator``,
    ``prefetch_factor``, ``persistent_workers``, ``pin_memory_device``,
    ``in_order``, ... as the installed torch has them).

    Args:
        loader: the loader.
        ignore_data_related_parameters: leave out ``sampler``, ``batch_sampler``,
            ``drop_last``, ``shuffle``, ``batch_size`` and ``dataset``.

    Returns:
        ``{parameter name: value}``.
    """
    ignored = {"self", *(_DATA_RELATED if ignore_data_related_parameters else ())}
    extracted = {}
    for name in inspect.signature(DataLoader.__init__).parameters:
        if name not in ignored and hasattr(loader, name):
            extracted[name] = getattr(loader, name)
    return extracted


def patch_dataloader_to_ddp(loader: DataLoader[Any]) -> DataLoader[Any]:
    """The same loader, its sampler or batch sampler sharded for DDP (OML's ``patch_dataloader_to_ddp``).

    As in OML: a loader whose batch sampler is exactly ``BatchSampler`` (the
    default) gets its *sampler* wrapped in :class:`~ddpkit.DDPSamplerWrapper` and
    is re-batched with the same batch size and ``drop_last``; any other batch
    sampler is wrapped as a whole (batches kept intact). Entries are padded so
    every rank gets the same number (``pad_data_to_num_gpus=True``) and not
    shuffled between ranks. Every other ``DataLoader`` argument is kept.

    A loader over an ``IterableDataset`` (which has no sampler; OML raises)
    becomes a :class:`~ddpkit.StreamDataLoader`: the stream is split over the
    ranks and the loader's workers (:class:`~ddpkit.ShardedStream`) and every
    rank yields the same number of batches (``ends="even"``), see
    :func:`stream_loader`.

    In a process that a launcher started as one of several ranks (torchrun,
    ``ddpkit run``, ``srun``, ``mpirun``) the default process group is created
    first if none exists (:func:`~ddpkit.ensure_dist_connection`). A process
    alone gets the loader back unchanged, with a :class:`~ddpkit.WarningDDP`.

    Raises:
        ClusterEnvironmentError: a launcher's variables are half-set, so the
            group cannot be made (naming them).
    """
    if not ensure_dist_connection():
        warnings.warn(patch_dataloader_to_ddp.__name__, WarningDDP, stacklevel=2)
        return loader
    if is_stream(loader):
        log.info("DataLoader over the stream '%s' is updated to DDP mode", type(loader.dataset).__name__)
        return stream_loader(loader)
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is BatchSampler:
        sampler = DDPSamplerWrapper(
            batch_sampler.sampler, shuffle_samples_between_gpus=False, pad_data_to_num_gpus=True
        )
        patched = _rebatched(loader, sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        info = f"'{type(batch_sampler.sampler).__name__}' sampler"
    elif batch_sampler is None:  # automatic batching disabled
        sampler = DDPSamplerWrapper(loader.sampler, shuffle_samples_between_gpus=False)
        patched = _rebatched(loader, sampler, None, False)
        info = f"'{type(loader.sampler).__name__}' sampler"
    else:
        wrapped = DDPSamplerWrapper(batch_sampler, shuffle_samples_between_gpus=False)
        patched = DataLoader(loader.dataset, batch_sampler=wrapped, **extract_loader_parameters(loader, True))
        info = f"'{type(batch_sampler).__name__}' batch sampler"
    log.info("DataLoader with %s is updated to DDP mode", info)
    return patched


def distributed_sampler_of(loader: DataLoader[Any]) -> DistributedSampler[Any] | None:
    """The ``DistributedSampler`` (ddpkit's wrappers included) that shards ``loader``, as its batch sampler or
    its sampler; ``None`` when it is not sharded."""
    for candidate in (loader.batch_sampler, loader.sampler):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


def check_loaders_is_patched(loaders: DataLoader[Any] | Sequence[DataLoader[Any]]) -> bool:
    """Whether every loader's sampler or batch sampler is sharded for DDP (OML's ``check_loaders_is_patched``).

    True for :class:`~ddpkit.DistributedSamplerWrapper` (so also
    :class:`~ddpkit.DDPSamplerWrapper`) and ``torch.utils.data.DistributedSampler``.
    """
    items = [loaders] if isinstance(loaders, DataLoader) else list(loaders)
    return all(distributed_sampler_of(loader) is not None for loader in items)


def build_loader_sampler(
    data_loader: DataLoader[Any],
    shuffle: bool,
    world_size: int,
    rank: int,
    *,
    even_shards: bool = True,
) -> tuple[DataLoader[Any], DistributedSamplerWrapper]:
    """Replicate a single-process loader with a distributed sampler added (aitoolbox's ``build_loader_sampler``).

    No process group is needed: ``world_size`` and ``rank`` are explicit. A
    loader with the default ``SequentialSampler``/``RandomSampler`` gets what
    ``DistributedSampler(dataset, shuffle=shuffle)`` would give; a custom sampler
    or batch sampler is kept and sharded (its positions also shuffled between
    ranks if ``shuffle``). Every other ``DataLoader`` argument is kept.

    Args:
        data_loader: the original single-process loader.
        shuffle: return the examples in a shuffled order (seeded with the epoch).
        world_size: number of processes.
        rank: this process's rank.
        even_shards: pad so every rank gets the same number of entries (default,
            as ``DistributedSampler``); ``False`` for evaluation without duplicates
            (see :func:`~ddpkit.gather_in_order`).

    Returns:
        ``(new loader, its distributed sampler)``; the sampler is a
        ``DistributedSampler`` subclass (call ``set_epoch`` as usual, or let the
        epochs advance by themselves).

    Raises:
        TypeError: the loader reads an ``IterableDataset``.
        ValueError: ``rank`` outside ``[0, world_size)``.
    """
    _refuse_iterable(data_loader, "build_loader_sampler")
    batch_sampler = data_loader.batch_sampler
    if batch_sampler is None or type(batch_sampler) is BatchSampler:
        inner = data_loader.sampler if batch_sampler is None else batch_sampler.sampler
        if type(inner) in (SequentialSampler, RandomSampler):  # the defaults: shard the dataset itself
            inner = SequentialSampler(data_loader.dataset)  # type: ignore[arg-type]
        sampler = DistributedSamplerWrapper(inner, world_size, rank, shuffle, even_shards=even_shards)
        if batch_sampler is None:
            return _rebatched(data_loader, sampler, None, False), sampler
        return _rebatched(data_loader, sampler, batch_sampler.batch_size, batch_sampler.drop_last), sampler
    sampler = DistributedSamplerWrapper(batch_sampler, world_size, rank, shuffle, even_shards=even_shards)
    loader = DataLoader(data_loader.dataset, batch_sampler=sampler, **extract_loader_parameters(data_loader, True))
    return loader, sampler


def stream_loader(
    loader: DataLoader[Any], ends: StreamEnds | None = None, world_size: int | None = None, rank: int | None = None
) -> StreamDataLoader:
    """``loader`` (over an ``IterableDataset``) rebuilt to read its rank's part of the stream.

    The stream is wrapped in a :class:`~ddpkit.ShardedStream` (unless it is
    one) and read by a :class:`~ddpkit.StreamDataLoader`; every other
    ``DataLoader`` argument is kept. A ``StreamDataLoader`` is returned as it
    is (with ``ends`` set, if given).

    Args:
        loader: a loader over a stream.
        ends: ``StreamEnds`` (default ``"even"``, or the
            ``StreamDataLoader``'s own).
        world_size, rank: as for :class:`~ddpkit.ShardedStream` (default: the process group's).

    Raises:
        TypeError: the loader does not read an ``IterableDataset``.
    """
    if not is_stream(loader):
        kind = type(loader.dataset).__name__
        raise TypeError(f"stream_loader needs a DataLoader over an IterableDataset, got one over a {kind}")
    if isinstance(loader, StreamDataLoader):
        if ends is not None:
            loader.ends = ends
        return loader
    stream = loader.dataset
    if not isinstance(stream, ShardedStream):
        stream = ShardedStream(stream, world_size, rank)
    kwargs = extract_loader_parameters(loader, ignore_data_related_parameters=True)
    if loader.batch_size is not None:
        kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    else:
        kwargs.update(batch_size=None)
    return StreamDataLoader(stream, ends=ends or "even", **kwargs)


def _rebatched(loader: DataLoader[Any], sampler: Any, batch_size: int | None, drop_last: bool) -> DataLoader[Any]:
    kwargs = extract_loader_parameters(loader, ignore_data_related_parameters=True)
    return DataLoader(loader.dataset, sampler=sampler, batch_size=batch_size, drop_last=drop_last, **kwargs)


def _refuse_iterable(loader: DataLoader[Any], what: str) -> None:
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(
            f"{what} cannot give a DataLoader over an IterableDataset ({type(loader.dataset).__name__}) a sampler: "
            "a stream has none. Use ddpkit.stream_loader(loader), which splits the stream over the ranks and the "
            "loader's workers (ddpkit.ShardedStream)"
        )
