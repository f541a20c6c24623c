"""gather_in_order: every rank's results back in single-process order, each sample exactly once.

Here, the tests that need no process; the others are in tests/ranks/test_ordered.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import (
    RandomSampler,
    SequentialSampler,
)

from ddpkit import DistributedSamplerWrapper, gather_in_order


def test_without_a_process_group() -> None:
    sampler = DistributedSamplerWrapper(RandomSampler(range(6)), 1, 0)
    order = list(sampler)
    assert gather_in_order([f"r{i}" for i in order], sampler) == [f"r{i}" for i in order]
    shard = DistributedSamplerWrapper(SequentialSampler(range(6)), 2, 1)
    assert gather_in_order(torch.tensor(list(shard)), shard).tolist() == [1, 3, 5], "one rank's part, in order"
    with pytest.raises(ValueError, match="passed 2 results but its shard holds 3 samples"):
        gather_in_order([0, 1], shard)
