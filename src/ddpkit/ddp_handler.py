"""``DDPHandler``: the DDP part of a train loop (aitoolbox's ``DDPHandler``)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DistributedSampler, RandomSampler

from ddpkit.callbacks import CallbacksHandler, DistributedSamplerSetEpoch
from ddpkit.collectives import gather_all_tensors, mp_sync, mp_sync_dict
from ddpkit.loaders import build_loader_sampler, distributed_sampler_of, stream_loader
from ddpkit.process_group import ensure_dist_connection, get_world_size
from ddpkit.samplers import DistributedSamplerWrapper
from ddpkit.streams import is_stream

__all__ = ["LOADER_ATTRIBUTES", "DDPHandler", "HasCallbacks"]

#: The train loop's loaders that ``add_distributed_samplers`` shards, and whether each is for evaluation.
LOADER_ATTRIBUTES = (("train_loader", False), ("validation_loader", True), ("test_loader", True))


class HasCallbacks(Protocol):
    """A train loop as ``DDPHandler`` needs it: its callbacks; its loaders are read and replaced by name
    (:data:`LOADER_ATTRIBUTES`, any may be missing or ``None``) and ``seed`` is read if present."""

    @property
    def callbacks_handler(self) -> CallbacksHandler: ...


class DDPHandler:
    """Distributed Data Parallel process handler for the TrainLoop (aitoolbox's ``DDPHandler``).

    Args:
        train_loop_obj: the encapsulating train loop; it has ``train_loader``,
            ``validation_loader``, ``test_loader`` (any may be ``None``),
            ``callbacks_handler`` and optionally ``seed``.
    """

    def __init__(self, train_loop_obj: HasCallbacks) -> None:
        self.train_loop_obj = train_loop_obj
        #: The distributed sampler of each sharded loader, by attribute name.
        self.samplers: dict[str, DistributedSampler[Any]] = {}
        #: The set-epoch callback ``add_distributed_samplers`` registered.
        self.callback: DistributedSamplerSetEpoch | None = None

    def add_distributed_samplers(self, world_size: int, rank: int) -> None:
        """Shard the train loop's loaders for DDP and keep their epochs right (aitoolbox's method).

        Unlike aitoolbox (which printed a warning for anything but the stock
        samplers), custom samplers and batch samplers are sharded too, and every
        ``DataLoader`` argument is kept (:func:`~ddpkit.build_loader_sampler`). The
        training loader is padded so all ranks take the same number of steps; the
        validation and test loaders are left uneven (no duplicates), which
        :func:`~ddpkit.gather_in_order` turns into exact metrics. A loader with a
        ``RandomSampler`` is shuffled as ``DistributedSampler(shuffle=True, seed=seed)``. Loaders that are
        already sharded are kept. A loader over an ``IterableDataset`` becomes a
        :class:`~ddpkit.StreamDataLoader` (:func:`~ddpkit.stream_loader`: the
        stream split over ranks and workers; aitoolbox refuses streams).
        Registers a :class:`~ddpkit.DistributedSamplerSetEpoch`.

        In a process that a launcher started as one of several ranks (torchrun,
        ``ddpkit run``, ``srun``, ``mpirun``) the default process group is
        created first if none exists (:func:`~ddpkit.ensure_dist_connection`).

        Args:
            world_size: world size of the distributed training.
            rank: rank of the current process.

        A loader sharded already keeps its sampler; a
        :class:`~ddpkit.DistributedSamplerWrapper` built with the default
        placement (before the group existed, e.g. in the process that calls
        ``fit_distributed``) is placed at ``rank`` of ``world_size``.

        Raises:
            ValueError: a default process group exists and some rank's
                ``world_size`` or ``rank`` contradict it, or a loader's sampler
                was sharded for another rank or world size by explicit
                ``num_replicas``/``rank`` (on every rank, naming each rank's
                values; one small gather checks it).
            ClusterEnvironmentError: a launcher's variables are half-set, so the
                group cannot be made (naming them).
        """
        loop = self.train_loop_obj
        problems = [
            problem
            for name, _ in LOADER_ATTRIBUTES
            if (problem := _misplaced_sampler(getattr(loop, name, None), name, world_size, rank)) is not None
        ]
        if ensure_dist_connection():
            _check_placement(world_size, rank, problems)
        elif problems:
            raise ValueError("; ".join(problems))
        seed = int(getattr(loop, "seed", 0))
        generators, streams = [], []
        for name, for_evaluation in LOADER_ATTRIBUTES:
            loader = getattr(loop, name, None)
            if loader is None:
                continue
            if is_stream(loader):  # no sampler: the stream is split inside the dataset
                streams.append(stream_loader(loader, world_size=world_size, rank=rank))
                setattr(loop, name, streams[-1])
                continue
            existing = distributed_sampler_of(loader)
            if existing is not None:
                if isinstance(existing, DistributedSamplerWrapper) and existing.default_placement:
                    # built before this rank's group existed (in the process that called fit_distributed, say)
                    existing.num_replicas, existing.rank = world_size, rank
                self.samplers[name] = existing
                continue
            shuffle = isinstance(loader.sampler, RandomSampler)
            rebuilt, sampler = build_loader_sampler(loader, shuffle, world_size, rank, even_shards=not for_evaluation)
            sampler.seed = seed
            if rebuilt.generator is None:
                # Starting an iterator draws a seed from the loader's generator, or else from the global
                # RNG: give it its own, so a resumed run draws exactly what the uninterrupted run drew.
                rebuilt.generator = torch.Generator()
                generators.append(rebuilt.generator)
            setattr(loop, name, rebuilt)
            self.samplers[name] = sampler
        self.callback = DistributedSamplerSetEpoch(
            self.samplers.get("train_loader"),
            self.samplers.get("validation_loader"),
            self.samplers.get("test_loader"),
            generators=generators,
            seed=seed,
            streams=streams,
        )
        loop.callbacks_handler.register_callbacks([self.callback])  # a list, as aitoolbox's handler expects

    build_loader_sampler = staticmethod(build_loader_sampler)

    def mp_sync(
        self,
        data: torch.Tensor | np.ndarray | list[Any] | float | int | bool,
        double_precision: bool = False,
        concat_mp_data: bool = True,
        return_tensor: bool = True,
    ) -> Any:
        """Multiprocess data sync (aitoolbox's): :func:`ddpkit.mp_sync`; a tensor's device is preserved."""
        return mp_sync(data, double_precision, concat_mp_data, return_tensor)

    def mp_sync_dict(self, dict_data: dict[Any, Any]) -> dict[Any, Any]:
        """Multiprocess sync of a dict (aitoolbox's): :func:`ddpkit.mp_sync_dict`, one exchange for all keys."""
        return mp_sync_dict(dict_data)


def _misplaced_sampler(loader: Any, name: str, world_size: int, rank: int) -> str | None:
    """What is wrong with ``loader``'s distributed sampler for rank ``rank`` of ``world_size``, or ``None``."""
    sampler = distributed_sampler_of(loader) if loader is not None and not is_stream(loader) else None
    if sampler is None or (sampler.num_replicas, sampler.rank) == (world_size, rank):
        return None
    if isinstance(sampler, DistributedSamplerWrapper) and sampler.default_placement:
        return None  # placed by add_distributed_samplers
    return (
        f"the {name}'s {type(sampler).__name__} was built for rank {sampler.rank} of {sampler.num_replicas}, but "
        f"this process is rank {rank} of {world_size}: build it without num_replicas and rank (they default to the "
        "process group's), or give TrainLoop the unsharded loader"
    )


def _check_placement(world_size: int, rank: int, problems: list[str]) -> None:
    """Raise on every rank unless every rank's ``(world_size, rank)`` is its place in the default group and no
    rank found a sampler built for another place (one gather)."""
    mine = torch.tensor([world_size, rank, int(bool(problems))])
    given = [tuple(values.tolist()) for values in gather_all_tensors(mine)]
    if all((w, r, bad) == (get_world_size(), index, 0) for index, (w, r, bad) in enumerate(given)):
        return
    if problems:
        raise ValueError("; ".join(problems))
    with_problems = [index for index, (_, _, bad) in enumerate(given) if bad]
    if with_problems:
        raise ValueError(
            f"rank(s) {', '.join(map(str, with_problems))} found a loader sharded for another rank or world size "
            "(their error says which); this rank stops too"
        )
    wrong = ", ".join(f"rank {index}: world_size={w}, rank={r}" for index, (w, r, _) in enumerate(given))
    raise ValueError(
        f"add_distributed_samplers got a world size or rank that contradicts the default process group of "
        f"{get_world_size()} ranks ({wrong}); pass world_size=ddpkit.get_world_size(), rank=ddpkit.get_rank()"
    )
