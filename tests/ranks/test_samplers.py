"""DistributedSamplerWrapper and DDPSamplerWrapper: sharding invariants, epochs, agreement across ranks.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_samplers.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, RandomSampler, Sampler

from ddpkit import CollectiveMismatchError, DDPSamplerWrapper, DistributedSamplerWrapper
from ddpkit.testing import run_parallel
from tests.support.samplers import GlobalRandomSampler

# --- across real ranks ----------------------------------------------------------------------------------


def _unseeded_epochs(n: int, epochs: int) -> list[list[int]]:
    torch.manual_seed(dist.get_rank())  # every rank's global RNG differs
    wrapper = DistributedSamplerWrapper(RandomSampler(range(n)), even_shards=False)
    return [list(wrapper) for _ in range(epochs)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_unseeded_random_sampler_sees_every_item_once_per_epoch(world_size: int) -> None:
    """Lightning's and OML's wrappers let each rank draw its own permutation here: ~25% of items lost."""
    results = run_parallel(_unseeded_epochs, 1000, 3, world_size=world_size)
    for epoch in range(3):
        seen = sorted(i for rank in results for i in rank[epoch])
        assert seen == list(range(1000))
    assert results[0][0] != results[0][1], "each epoch is a new permutation"


def _global_rng_sampler() -> list[int]:
    torch.manual_seed(100 + dist.get_rank())
    return list(DistributedSamplerWrapper(GlobalRandomSampler(40), even_shards=False))


def test_samplers_that_use_the_global_rng_agree_across_ranks() -> None:
    results = run_parallel(_global_rng_sampler, world_size=3)
    assert sorted(i for r in results for i in r) == list(range(40))


class PrivateRandomSampler(Sampler[int]):
    """Randomness ddpkit cannot reach: a numpy Generator of its own, seeded per rank."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.rng = n, np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(self.rng.permutation(self.n).tolist())


def _disagreeing(kind: str, check_order: bool) -> str:
    rank = dist.get_rank()
    sampler: Any = {
        "private": lambda: PrivateRandomSampler(20, seed=rank),
        "own generator": lambda: RandomSampler(range(20), generator=torch.Generator().manual_seed(rank)),
        "batched private": lambda: BatchSampler(PrivateRandomSampler(20, seed=rank), 4, False),
        "agreeing private": lambda: PrivateRandomSampler(20, seed=0),
    }[kind]()
    try:
        list(DistributedSamplerWrapper(sampler, check_order=check_order))
    except CollectiveMismatchError as exc:
        return str(exc)
    return "ok"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("private", "draws from randomness of its own"),
        ("own generator", "holds a torch.Generator of its own that is not seeded the same on every rank"),
        ("batched private", "different order on different ranks in epoch 0"),
        ("agreeing private", "ok"),
    ],
)
def test_disagreeing_ranks_raise_on_every_rank_with_the_fix(kind: str, message: str) -> None:
    for result in run_parallel(_disagreeing, kind, True):
        assert message in result
    assert run_parallel(_disagreeing, kind, False) == ["ok", "ok"], "check_order=False trusts the sampler"


# --- DDPSamplerWrapper (OML) ------------------------------------------------------------------------------


def _oml(shuffle: bool, pad: bool) -> list[list[Any]]:
    torch.manual_seed(5)  # the same on every rank, as in a seeded single-process run
    wrapper = DDPSamplerWrapper(RandomSampler(range(9)), shuffle, pad)
    epochs = [list(wrapper), list(wrapper)]
    return [*epochs, [wrapper.epoch, wrapper.seed_shift_per_epoch]]


def test_ddp_sampler_wrapper_deals_out_every_item_each_epoch() -> None:
    rank0, rank1 = run_parallel(_oml, False, True)
    for epoch in (0, 1):
        assert sorted(rank0[epoch] + rank1[epoch]) == sorted([*range(9), rank0[epoch][0]]), "each once, one padded"
    assert rank0[0] != rank0[1], "a new epoch, a new order"
    assert rank0[2] == [1, 2]


def _seeded_per_rank() -> tuple[list[int], int | None]:
    torch.manual_seed(10 + dist.get_rank())  # ranks seeded differently: rank 0's base seed is shared
    wrapper = DDPSamplerWrapper(RandomSampler(range(12)), shuffle_samples_between_gpus=False)
    return list(wrapper), wrapper.base_seed


def test_ddp_sampler_wrapper_ranks_agree_on_rank_zeros_base_seed() -> None:
    (shard0, seed0), (shard1, seed1) = run_parallel(_seeded_per_rank)
    torch.manual_seed(10)
    assert seed0 == seed1 == int(torch.empty((), dtype=torch.int64).random_().item()), "drawn as DataLoader does"
    assert sorted(shard0 + shard1) == list(range(12))


@pytest.mark.parametrize(("pad", "lengths"), [(True, [5, 5]), (False, [4, 4])])
def test_ddp_sampler_wrapper_pads_or_drops(pad: bool, lengths: list[int]) -> None:
    results = run_parallel(_oml, True, pad)
    assert [len(r[0]) for r in results] == lengths
    items = [i for r in results for i in r[0]]
    assert len(set(items)) == (9 if pad else 8)
