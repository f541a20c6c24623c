"""Hugging Face ``datasets.IterableDataset`` streams: split by their own shards over ranks x DataLoader workers.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_hf_streams.py.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from ddpkit import StreamDataLoader, patch_dataloader_to_ddp
from ddpkit.testing import run_parallel
from tests.helpers import SETTLED_FORK
from tests.support.hf_streams import _numbers

datasets = pytest.importorskip("datasets")

ITEMS = 101
_FORK = SETTLED_FORK


def _logged_shards(shards: list[int], log: str) -> Iterator[dict[str, int]]:
    """A generator of shards that leaves a file for every shard it opens (which process read which shard)."""
    for shard in shards:
        Path(log, f"{shard}-{os.getpid()}").touch()
        size = -(-ITEMS // 8)
        for number in range(shard * size, min(ITEMS, (shard + 1) * size)):
            yield {"x": number}


def _read(shards: int, workers: int, log: str | None = None) -> dict[str, Any]:
    if log is None:
        stream = _numbers(shards)
    else:
        kwargs = {"shards": list(range(shards)), "log": log}
        stream = datasets.IterableDataset.from_generator(_logged_shards, gen_kwargs=kwargs)
    loader = patch_dataloader_to_ddp(_loader(stream, workers))  # a plain DataLoader, patched as any other
    assert isinstance(loader, StreamDataLoader)
    items, keys = [], []
    for tagged in loader.iter_tagged():
        if not tagged.padding:
            items += tagged.batch["x"].tolist()
            keys += tagged.keys.tolist()
    return {"items": items, "keys": keys, "split": loader.stream.split_for(workers)}


def _loader(stream: Any, workers: int) -> DataLoader[Any]:
    return DataLoader(stream, batch_size=4, num_workers=workers, multiprocessing_context=_FORK if workers else None)


@pytest.mark.parametrize(("world_size", "workers"), [(2, 0), (2, 2), (3, 2)])
def test_every_item_of_a_hugging_face_stream_is_read_once(world_size: int, workers: int) -> None:
    results = run_parallel(_read, 8, workers, world_size=world_size)
    counts = Counter(item for result in results for item in result["items"])
    assert sorted(counts) == list(range(ITEMS))
    assert set(counts.values()) == {1}
    # 8 shards split by shard when ranks x workers divides them (as split_dataset_by_node), else by example
    expected = "shard" if 8 % (world_size * max(workers, 1)) == 0 else "example"
    assert {result["split"] for result in results} == {expected}


def test_each_rank_and_worker_opens_only_its_own_shards(tmp_path: Path) -> None:
    results = run_parallel(_read, 8, 2, str(tmp_path))
    counts = Counter(item for result in results for item in result["items"])
    assert sorted(counts) == list(range(ITEMS))
    assert set(counts.values()) == {1}
    opened = [name.split("-") for name in os.listdir(tmp_path)]
    assert sorted(int(shard) for shard, _ in opened) == list(range(8)), "every shard opened exactly once"
    assert len({pid for _, pid in opened}) == 4, "by the 2 ranks x 2 workers"
    for result in results:  # each rank's items come from its own shards: unit rank * 2 + worker reads u, u + 4
        shards = {shard for shard, _, _ in result["keys"]}
        assert len(shards) == 4
