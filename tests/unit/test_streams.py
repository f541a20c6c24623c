"""Streams under DDP: split over ranks x DataLoader workers, the three ends, ordered gather, resume, TrainLoop.

Here, the tests that need no process; the others are in tests/ranks/test_streams.py.
"""

from __future__ import annotations

import pytest
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import (
    ShardedStream,
    StreamDataLoader,
    TrainLoop,
    stream_loader,
)
from tests.support.streams import Numbers, _regression, _Sample


def test_bad_arguments_name_the_values() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        ShardedStream(Numbers(3), 2, 2)
    with pytest.raises(ValueError, match=r"world_size=2 and rank=None: give both, or neither"):
        ShardedStream(Numbers(3), 2)
    with pytest.raises(ValueError, match=r"split='shard' needs a dataset with num_shards.*Numbers"):
        ShardedStream(Numbers(3), split="shard")
    with pytest.raises(ValueError, match=r"ends='pad' must be one of 'even', 'drop', 'join'"):
        StreamDataLoader(Numbers(3), ends="pad")  # type: ignore[arg-type]
    model = _regression()
    with pytest.raises(ValueError, match=r"global_batch_size=8 needs a training set with a global order"):
        TrainLoop(model, DataLoader(_Sample(), batch_size=4), criterion=nn.MSELoss(), global_batch_size=8).fit(1)
    with pytest.raises(TypeError, match=r"stream_loader needs a DataLoader over an IterableDataset"):
        stream_loader(DataLoader([1, 2]))
