"""One deal for DDP and fault tolerance: what a rank's distributed sampler gives it in a global batch's step is
what a quorum's deal gives the worker of the same number, with the same batch seeds and loss divisors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import SequentialSampler

from ddpkit.samplers import DistributedSamplerWrapper
from ddpkit.training._deal import batch_seed, first_position, share_sizes, shares, step_divisor
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


@pytest.mark.parametrize("step_items", [0, 1, 7, 64, 83])
@pytest.mark.parametrize(("workers", "batch"), [(1, 8), (2, 4), (3, 4), (5, 2), (9, 3)])
def test_share_sizes_are_the_sizes_of_the_shares_batches(step_items: int, workers: int, batch: int) -> None:
    step = torch.arange(100, 100 + step_items)
    for worker in range(workers):
        assert share_sizes(step_items, workers, worker, batch) == [len(b) for b in shares(step, workers, worker, batch)]


def test_batch_seeds_are_63_bit_and_differ_with_each_of_seed_epoch_and_position() -> None:
    seeds = {batch_seed(seed, epoch, first) for seed in (0, 1, 2**64 + 5) for epoch in range(4) for first in range(50)}
    assert len(seeds) == 3 * 4 * 50  # no two alike
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert batch_seed(-1, 0, 0) == batch_seed(2**64 - 1, 0, 0)  # each taken modulo 2**64
    assert batch_seed(3, 2, 10) == batch_seed(3, 2, 10)
