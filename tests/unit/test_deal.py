"""One deal for DDP and fault tolerance: what a rank's distributed sampler gives it in a global batch's step is
what a quorum's deal gives the worker of the same number, with the same batch seeds and loss divisors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import SequentialSampler

from ddpkit.samplers import DistributedSamplerWrapper
from ddpkit.training._deal import batch_seed, first_position, shares, step_divisor
from ddpkit.training._steps import GlobalBatch


@pytest.mark.parametrize(("items", "world_size", "batch"), [(83, 2, 4), (83, 3, 4), (40, 4, 2), (41, 1, 8)])
@pytest.mark.parametrize("start", [0, 12])
def test_a_ranks_sampler_in_a_global_batch_deals_what_a_quorum_deals_its_worker(
    items: int, world_size: int, batch: int, start: int
) -> None:
    size, seed, epoch = world_size * batch * 2, 5, 3  # two batches a rank per step
    data = SequentialSampler(range(items))
    whole = DistributedSamplerWrapper(data, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=False,
                                      even_shards=False)  # fmt: skip
    whole.set_epoch(epoch)
    order = torch.tensor(list(whole))
    for rank in range(world_size):
        sampler = DistributedSamplerWrapper(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                            drop_last=False, even_shards=False)  # fmt: skip
        sampler.set_epoch(epoch)
        sampler.set_position(start)
        mine = list(sampler)
        assert sampler.last_layout is not None
        plan = GlobalBatch(size).epoch(sampler.last_layout, rank, batch, seed, epoch)
        batches = [mine[i : i + batch] for i in range(0, len(mine), batch)]
        index = 0
        for low in range(start, items, size):
            step = order[low : low + size]
            dealt = shares(step, world_size, rank, batch)
            for number, chunk in enumerate(dealt):
                assert batches[index] == chunk.tolist(), (rank, low, number)
                first = first_position(low, world_size, rank, number, batch)
                assert plan.batch_seed(index) == batch_seed(seed, epoch, first)
                assert plan.divisor(index) == step_divisor(len(step), len(chunk), world_size)
                index += 1
        assert index == len(batches)
