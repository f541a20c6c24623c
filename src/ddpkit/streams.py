"""Streamed data under DDP: an ``IterableDataset`` split over ranks and DataLoader workers, and even ends.

A stream has no sampler to shard, so the split happens inside the dataset.
:class:`ShardedStream` reads the wrapped stream and keeps one *unit*'s part:
unit ``rank * workers + worker`` of ``U = world_size * workers`` (``workers``
is the DataLoader's ``num_workers``, at least 1). A dataset that exposes
shards (``num_shards`` and ``iter_shard(i)``, e.g. files) is split by shard
when ``U`` divides the shard count (unit ``u`` reads shards ``u, u + U, ...``,
nothing else is read); otherwise by example (every unit reads the stream and
keeps items ``u, u + U, ...``), as Hugging Face's ``split_dataset_by_node``.

Every item has a key ``(shard, offset in shard, index in stream)`` (the index
is ``-1`` when split by shard). :class:`StreamDataLoader` carries the keys
beside each batch: they give evaluation its order back
(:func:`~ddpkit.gather_stream_in_order`) and a checkpoint the items consumed,
so a resumed epoch neither replays nor skips any.

Streams end unevenly (ranks get different numbers of batches); the choice of
``StreamEnds`` says what then happens, agreed by one small all-reduce per
8 batches read ahead.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, default_collate, default_convert, get_worker_info

from ddpkit._stream_progress import StreamProgress, TakenItems
from ddpkit._stream_shards import num_shards, read_all, shard_source
from ddpkit.environments import launched_environment
from ddpkit.errors import DDPKitError
from ddpkit.process_group import collective_device, ensure_dist_connection, get_rank, get_world_size, is_distributed

__all__ = ["ShardedStream", "StreamBatch", "StreamDataLoader", "StreamEnds", "StreamProgress", "is_stream"]

#: What happens when the ranks' shares of a stream end at different batches:
#:
#: * ``"even"`` (default): every rank yields as many batches as the longest;
#:   a rank that ran out repeats its first batches of the epoch (padding, as
#:   ``DistributedSampler`` pads), flagged :attr:`StreamBatch.padding`.
#: * ``"drop"``: every rank stops when the first runs out (the others' last
#:   batches are not used).
#: * ``"join"``: each rank yields exactly its share (no collective); wrap the
#:   training step in ``torch.distributed.algorithms.Join([ddp_model])`` so
#:   the ranks still stepping do not hang. ``TrainLoop`` does it differently:
#:   a rank that ran out steps along on a padding batch whose loss counts zero.
StreamEnds = Literal["even", "drop", "join"]
Split = Literal["auto", "shard", "example"]
_ENDS = ("even", "drop", "join")
#: Padding cycles through at most this many of a rank's first batches of the epoch.
_PADDING_BATCHES = 8
#: Batches read ahead per agreement: the ranks agree once per this many batches how many each yields.
_AHEAD = 8


def is_stream(loader: DataLoader[Any]) -> bool:
    """Whether ``loader`` reads an ``IterableDataset`` (which has no sampler to shard)."""
    return isinstance(loader.dataset, IterableDataset)


class ShardedStream(IterableDataset[Any]):
    """One rank's part of an ``IterableDataset``, split again over the DataLoader's workers.

    Usable on its own (``DataLoader(ShardedStream(stream), batch_size=32,
    num_workers=2)``: each worker reads its part) or through
    :class:`StreamDataLoader`, which ``patch_dataloader_to_ddp``, ``DDPHandler``
    and ``TrainLoop`` build for a loader over a stream. Hugging Face's
    ``split_dataset_by_node`` and Accelerate's ``IterableDatasetShard`` do the
    same job (Accelerate reads every item on every rank).

    Args:
        dataset: the stream. To be split by shard it has ``num_shards`` (int)
            and ``iter_shard(index)`` (an iterator over shard ``index``'s items,
            the stream being shards ``0, 1, ...`` in order), or it is a Hugging
            Face ``datasets.IterableDataset`` (split by its own shards, as
            ``datasets.distributed.split_dataset_by_node`` does, and never read
            whole by every unit); ``set_epoch`` is forwarded to it if it has one.
        world_size: ranks to split over (default: the process group's size,
            taken in the main process when the stream is read, so a stream
            built before the group exists is split right; a launcher's rank
            without its group yet creates it first, see
            :func:`~ddpkit.ensure_dist_connection`; 1 alone). A DataLoader
            worker uses what its main process took when the loader's iterator
            was created (with ``fork``, the group it inherited), never
            environment variables.
        rank: this process's rank (default: likewise).
        split: ``"auto"`` (default: by shard when the dataset has shards and
            ranks x workers divides their number, else by example), ``"shard"``
            (always by shard: units may get different numbers of shards, or
            none) or ``"example"``.

    Raises:
        ValueError: ``rank`` outside ``[0, world_size)`` (or only one of them
            given), an unknown ``split``, ``split="shard"`` for a dataset without
            shards, or a Hugging Face stream already split by ``split_dataset_by_node``.
    """

    def __init__(
        self, dataset: Any, world_size: int | None = None, rank: int | None = None, *, split: Split = "auto"
    ) -> None:
        if (world_size is None) != (rank is None):
            raise ValueError(f"world_size={world_size} and rank={rank}: give both, or neither (the job's)")
        if world_size is not None and rank is not None and not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if split not in ("auto", "shard", "example"):
            raise ValueError(f"split={split!r} must be 'auto', 'shard' or 'example'")
        source = shard_source(dataset)
        if split == "shard" and num_shards(source) is None:
            raise ValueError(
                f"split='shard' needs a dataset with num_shards and iter_shard(index); {type(dataset).__name__} "
                "has not: use split='example'"
            )
        self.dataset = dataset
        self._source = source
        self._placement = None if world_size is None or rank is None else (world_size, rank)
        #: ``(world_size, rank)`` as the main process took it when a DataLoader's workers started.
        self._resolved: tuple[int, int] | None = None
        self.split = split
        self.epoch = 0
        #: The items a resumed epoch skips (read from a checkpoint); used by the next iteration only.
        self.consumed: tuple[Any, ...] = ()
        #: Whether iterating yields ``(key, item)`` pairs (see :meth:`keyed`).
        self.yields_keys = False

    @property
    def world_size(self) -> int:
        """The ranks the stream is split over (see the class's arguments)."""
        return self.placement()[0]

    @property
    def rank(self) -> int:
        """This process's rank among them."""
        return self.placement()[1]

    def placement(self) -> tuple[int, int]:
        """``(world_size, rank)``: as given, else the process group's (see the class's arguments).

        Raises:
            ClusterEnvironmentError: in the main process, a launcher's variables are half-set.
            DDPKitError: in a DataLoader worker whose main process had no group when the
                workers started although a launcher started it as one of several ranks.
        """
        if self._placement is not None:
            return self._placement
        if get_worker_info() is None:
            ensure_dist_connection()
            return get_world_size(), get_rank()
        if self._resolved is not None:
            return self._resolved
        if is_distributed():  # a forked worker: the main process's group
            return get_world_size(), get_rank()
        if launched_environment() is not None:
            raise DDPKitError(
                "a ShardedStream in a DataLoader worker cannot tell its rank: its main process had no process group "
                "when the loader's workers started. Read it through ddpkit.StreamDataLoader (or "
                "patch_dataloader_to_ddp), create the group before iterating (ddpkit.ensure_dist_connection()), "
                "or pass world_size and rank"
            )
        return 1, 0

    @contextlib.contextmanager
    def placed(self) -> Iterator[tuple[int, int]]:
        """Within the block, the placement is the one taken on entering it (:meth:`placement`), also in the copies
        of the stream that DataLoader workers started within the block get."""
        self._resolved = self.placement()
        try:
            yield self._resolved
        finally:
            self._resolved = None

    def keyed(self) -> ShardedStream:
        """A copy that yields ``(key, item)``, ``key`` the item's ``(shard, offset, index)`` (as a
        :class:`StreamDataLoader` reads it)."""
        stream = copy.copy(self)
        stream.yields_keys = True
        return stream

    def __getstate__(self) -> dict[str, Any]:
        """Pickled to a DataLoader's workers: the main process's placement goes along (``_resolved``)."""
        state = self.__dict__.copy()
        if self._placement is None and self._resolved is None and get_worker_info() is None and is_distributed():
            state["_resolved"] = (get_world_size(), get_rank())
        return state

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (forwarded to the wrapped dataset's ``set_epoch``, if any)."""
        self.epoch = epoch
        if hasattr(self._source, "set_epoch"):
            self._source.set_epoch(epoch)

    def split_for(self, workers: int) -> Literal["shard", "example"]:
        """How the stream is split over ``world_size`` x ``max(workers, 1)`` units for the next iteration."""
        shards = num_shards(self._source)
        if shards is None or self.split == "example" or any(layer[0] == "example" for layer in self.consumed):
            return "example"  # (a resumed epoch that was split by example goes on by example: only it knows indices)
        if self.split == "shard" or shards % (self.world_size * max(workers, 1)) == 0:
            return "shard"
        return "example"

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        world_size, rank = self.placement()
        units, unit = world_size * workers, rank * workers + worker
        skip = TakenItems(self.consumed)
        if self.split_for(workers) == "shard":
            shards = num_shards(self._source)
            assert shards is not None
            keyed = (
                ((shard, offset, -1), item)
                for shard in range(unit, shards, units)
                for offset, item in enumerate(self._source.iter_shard(shard))
            )
        else:
            keyed = (
                ((shard, offset, unit + k * units), item)
                for k, (shard, offset, item) in enumerate(itertools.islice(read_all(self._source), unit, None, units))
            )
        if skip:
            keyed = ((key, item) for key, item in keyed if not skip(key))
        return keyed if self.yields_keys else (item for _, item in keyed)


@dataclass(frozen=True)
class StreamBatch:
    """One batch of a :class:`StreamDataLoader` with what it holds.

    Attributes:
        batch: the batch, as the loader's ``collate_fn`` made it.
        keys: ``(items, 3)`` int64: each item's shard, offset in that shard, and
            index in the whole stream (``-1`` when the stream was split by shard).
        padding: a repeat of an earlier batch (``ends="even"``), not new data.
    """

    batch: Any
    keys: torch.Tensor
    padding: bool = False


class StreamDataLoader(DataLoader[Any]):
    """A ``DataLoader`` over a :class:`ShardedStream` whose ranks end together (or join), with items' keys.

    Takes every ``DataLoader`` argument (no sampler: a stream has none).
    Iterating it yields batches as a ``DataLoader`` does; :meth:`iter_tagged`
    also says which items each holds. Every rank must iterate it together
    (``ends="even"`` and ``"drop"`` agree on the end by one all-reduce of a
    3-element tensor per 8 batches, while the next 8 are read).

    Args:
        dataset: a :class:`ShardedStream` (another ``IterableDataset`` is wrapped in one).
        ends: ``StreamEnds`` (default ``"even"``: every rank takes the same
            number of steps, as with ``DistributedSampler``, so a plain training
            loop cannot hang and no item is dropped; ``"join"`` repeats none,
            but a hand-written loop needs torch's ``Join``).
        *args: positional arguments, as ``**kwargs``.
        **kwargs: ``DataLoader``'s.

    Raises:
        ValueError: an unknown ``ends``; while iterating with ``"even"``: some
            rank has no batch at all to pad with (on every rank).
    """

    def __init__(self, dataset: Any, *args: Any, ends: StreamEnds = "even", **kwargs: Any) -> None:
        if ends not in _ENDS:
            raise ValueError(f"ends={ends!r} must be one of {', '.join(map(repr, _ENDS))}")
        stream = (dataset if isinstance(dataset, ShardedStream) else ShardedStream(dataset)).keyed()
        kwargs["collate_fn"] = _KeyedCollate(kwargs.get("collate_fn"))
        self.ends = ends
        #: The items this rank has taken in the current epoch (by the consumers of :meth:`iter_tagged`).
        self.progress = StreamProgress()
        self._padding: list[tuple[torch.Tensor, Any]] = []
        self._iterator_state: tuple[Any, ...] | None = None
        super().__init__(stream, *args, **kwargs)

    @property
    def stream(self) -> ShardedStream:
        """The :class:`ShardedStream` read."""
        assert isinstance(self.dataset, ShardedStream)
        return self.dataset

    def set_epoch(self, epoch: int) -> None:
        """Set the stream's epoch (see :meth:`ShardedStream.set_epoch`)."""
        self.stream.set_epoch(epoch)

    def resume(self, consumed: list[Any]) -> None:
        """Skip, in the next epoch iterated, the items ``consumed`` lists (a ``StreamProgress.merged`` state)."""
        self.stream.consumed = tuple(consumed)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for tagged in self.iter_tagged(self.ends):
            yield tagged.batch

    def iter_tagged(self, ends: StreamEnds | None = None, count: bool = True) -> Iterator[StreamBatch]:
        """The epoch's batches with their keys, the ends as ``ends`` (default the loader's) say.

        With ``count`` (default), the items of every batch it yields (not padding)
        count as taken in :attr:`progress` (a consumer that reads ahead counts
        them itself, when it uses them: ``progress.add(batch.keys)``).

        Raises:
            ValueError: ``ends="even"`` and some rank has no batch to pad with (on every rank).
        """
        ends = self.ends if ends is None else ends
        stream = self.stream
        self.progress = StreamProgress(stream.split_for(self.num_workers), stream.world_size * max(self.num_workers, 1))
        self.progress.previous = list(stream.consumed)
        # Taken here, in the main process, before the workers start: they get it with their copy of the stream.
        with stream.placed() as placement:
            state = (stream.epoch, stream.consumed, placement)
            if self.persistent_workers and state != self._iterator_state:
                self._iterator = None  # persistent workers hold the stream as it was when they started
            self._iterator_state = state
            source = super().__iter__()
        stream.consumed = ()  # the workers have their copy (or the fetcher its iterator): only this epoch skips
        agree = ends != "join" and get_world_size() > 1
        device = collective_device() if agree else None
        padded, fresh = 0, True

        def read() -> deque[tuple[torch.Tensor, Any]]:
            chunk: deque[tuple[torch.Tensor, Any]] = deque(itertools.islice(source, _AHEAD))
            return chunk

        def agree_on(chunk: deque[Any]) -> Any:
            """Start the all-reduce of (most, _AHEAD - least, some rank cannot pad) over the ranks' chunks."""
            flags = [len(chunk), _AHEAD - len(chunk), int(not chunk and not self._padding)]
            agreed = torch.tensor(flags, dtype=torch.int64, device=device)
            return agreed, dist.all_reduce(agreed, op=dist.ReduceOp.MAX, async_op=True) if agree else None

        chunk = read()
        pending = agree_on(chunk)
        while True:  # rounds: each rank's next _AHEAD batches, and one agreement on how many every rank yields
            following = read() if len(chunk) == _AHEAD else deque()  # read on while the agreement is under way
            agreed, work = pending
            if work is not None:
                work.wait()
            most, least, unpaddable = int(agreed[0]), _AHEAD - int(agreed[1]), bool(agreed[2])
            take = least if ends == "drop" else most
            if take and unpaddable and least < most:
                raise ValueError(
                    "a rank got no batch of this stream to pad with (ends='even'): the stream has fewer items than "
                    "ranks x workers x batch size. Use ends='join' or a longer stream"
                )
            for _ in range(take):
                if chunk:
                    keys, batch = chunk.popleft()
                    if fresh:
                        self._padding, fresh = [], False
                    if len(self._padding) < _PADDING_BATCHES:
                        self._padding.append((keys, batch))
                    if count:
                        self.progress.add(keys)
                    yield StreamBatch(batch, keys)
                else:
                    keys, batch = self._padding[padded % len(self._padding)]
                    padded += 1
                    yield StreamBatch(batch, keys, padding=True)
            if most < _AHEAD or (ends == "drop" and least < _AHEAD):
                return  # every rank ran out in this round, or (drop) the first one did
            chunk = following
            pending = agree_on(chunk)


class _KeyedCollate:
    """Collate keyed items into ``(keys (n, 3) int64, collate_fn(items))`` (in the DataLoader's workers)."""

    def __init__(self, collate_fn: Any) -> None:
        while isinstance(collate_fn, _KeyedCollate):
            collate_fn = collate_fn.collate_fn
        self.collate_fn: Any = collate_fn

    def __call__(self, keyed: Any) -> tuple[torch.Tensor, Any]:
        if isinstance(keyed, tuple) and len(keyed) == 2 and isinstance(keyed[0], tuple):  # no automatic batching
            key, item = keyed
            return torch.tensor([key], dtype=torch.int64), (self.collate_fn or default_convert)(item)
        keys = torch.tensor([key for key, _ in keyed], dtype=torch.int64).reshape(-1, 3)
        return keys, (self.collate_fn or default_collate)([item for _, item in keyed])
