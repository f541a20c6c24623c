"""What a stream's shards are: a dataset's own ``num_shards``/``iter_shard``, or a Hugging Face stream's.

:class:`~ddpkit.ShardedStream` splits a stream by shard when it can (each
rank x DataLoader worker reads only its shards) and by example otherwise. It
reads a stream through a *shard source*: the dataset itself when it has
``num_shards`` (an int) and ``iter_shard(index)``; for a Hugging Face
``datasets.IterableDataset``, :class:`HuggingFaceShards`, which reads its own
shards (``num_shards``) one at a time; anything else is one shard read whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ddpkit._torch_private import worker_info_hidden

__all__ = ["HuggingFaceShards", "num_shards", "read_all", "shard_source"]


def shard_source(dataset: Any) -> Any:
    """The object to read ``dataset``'s shards through: a :class:`HuggingFaceShards` for a Hugging Face
    ``datasets.IterableDataset``, else ``dataset`` itself.

    Raises:
        ValueError: a Hugging Face stream that ``split_dataset_by_node`` split already.
    """
    if is_huggingface_stream(dataset):
        return HuggingFaceShards(dataset)
    return dataset


def is_huggingface_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.IterableDataset`` (checked without importing ``datasets``)."""
    return any(
        cls.__name__ == "IterableDataset" and cls.__module__.split(".")[0] == "datasets"
        for cls in type(dataset).__mro__
    )


def num_shards(source: Any) -> int | None:
    """The shard count of a shard source (``num_shards`` with ``iter_shard``), or ``None`` when it has none."""
    shards = getattr(source, "num_shards", None)
    if isinstance(shards, int) and not isinstance(shards, bool) and callable(getattr(source, "iter_shard", None)):
        return shards
    return None


def read_all(source: Any) -> Iterator[tuple[int, int, Any]]:
    """``(shard, offset, item)`` of the whole stream, shard by shard (one shard ``0`` without shards)."""
    shards = num_shards(source)
    if shards is None:
        return ((0, offset, item) for offset, item in enumerate(source))
    return ((shard, offset, item) for shard in range(shards) for offset, item in enumerate(source.iter_shard(shard)))


class HuggingFaceShards:
    """A Hugging Face ``datasets.IterableDataset`` read one of its own shards at a time.

    ``num_shards`` is the dataset's (``Dataset.to_iterable_dataset(num_shards=8)``,
    or one per file of a streamed dataset); ``iter_shard(i)`` reads shard ``i``
    alone (``dataset.shard(num_shards, i)``) in the dataset's format and at its
    epoch. Iterated inside a DataLoader worker, a Hugging Face stream splits
    itself over the loader's workers; here a shard is one unit's alone, so it is
    read as in the main process.

    Args:
        dataset: the ``datasets.IterableDataset``, not yet split by
            ``datasets.distributed.split_dataset_by_node``.

    Raises:
        ValueError: ``dataset`` was split by node already (ddpkit splits it over
            ranks and workers itself; a second split would drop items).
    """

    def __init__(self, dataset: Any) -> None:
        if getattr(dataset, "_distributed", None) is not None:
            raise ValueError(
                "this Hugging Face IterableDataset was split already (datasets.distributed.split_dataset_by_node): "
                "ddpkit splits a stream over the ranks and DataLoader workers itself, and a second split would drop "
                "items. Pass the dataset before split_dataset_by_node"
            )
        self.dataset = dataset

    @property
    def num_shards(self) -> int:
        """The dataset's shard count."""
        return int(self.dataset.num_shards)

    def set_epoch(self, epoch: int) -> None:
        """Set the dataset's epoch (its shuffling, if any, depends on it)."""
        self.dataset.set_epoch(epoch)

    def iter_shard(self, index: int) -> Iterator[Any]:
        """The items of shard ``index``, in order."""
        shard = self.dataset.shard(num_shards=self.num_shards, index=index, contiguous=True)
        shard.set_epoch(self.dataset.epoch)
        items = iter(shard)
        while True:
            with _as_main_process():
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item

    def __iter__(self) -> Iterator[Any]:
        return (item for _, _, item in read_all(self))


@contextlib.contextmanager
def _as_main_process() -> Iterator[None]:
    """Within the block, ``torch.utils.data.get_worker_info()`` is ``None`` (restored afterwards)."""
    with worker_info_hidden():
        yield
