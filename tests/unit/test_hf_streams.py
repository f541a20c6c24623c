"""Hugging Face ``datasets.IterableDataset`` streams: split by their own shards over ranks x DataLoader workers.

Small local datasets only (``Dataset.from_dict(...).to_iterable_dataset(num_shards=...)``,
``IterableDataset.from_generator``): no network.

Here, the tests that need no process; the others are in tests/ranks/test_hf_streams.py.
"""

from __future__ import annotations

import pytest

from ddpkit import ShardedStream
from tests.support.hf_streams import ITEMS, _numbers


def test_a_hugging_face_stream_split_by_node_already_is_refused() -> None:
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(_numbers(8), rank=0, world_size=2)
    with pytest.raises(ValueError, match="split_dataset_by_node"):
        ShardedStream(split, 2, 0)


def test_a_hugging_face_stream_alone_reads_in_its_own_order() -> None:
    stream = _numbers(4)
    assert [row["x"] for row in ShardedStream(stream, 1, 0)] == list(range(ITEMS))
