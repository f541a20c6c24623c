"""aitoolbox's DDPHandler: all three loaders sharded (custom batch samplers too), epochs kept right, mp_sync.

Here, the tests that need no process; the others are in tests/ranks/test_ddp_handler.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler, TensorDataset

from ddpkit import CallbacksHandler, DDPHandler, DistributedSamplerSetEpoch

N = 23  # not divisible by the world size below


class _PairsOfBatches(Sampler[list[int]]):
    """A custom batch sampler: batches of 2 from a shuffled order drawn from ``generator``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator: torch.Generator | None = None

    def __len__(self) -> int:
        return (self.n + 1) // 2

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator).tolist()
        for start in range(0, self.n, 2):
            yield order[start : start + 2]


@dataclass
class _Loop:
    """What aitoolbox's handler needs from its train loop."""

    train_loader: DataLoader[Any]
    validation_loader: DataLoader[Any] | None
    test_loader: DataLoader[Any] | None
    seed: int = 0
    epoch: int = 0
    callbacks_handler: CallbacksHandler = field(init=False)

    def __post_init__(self) -> None:
        self.callbacks_handler = CallbacksHandler(self)


def _loop() -> _Loop:
    data = TensorDataset(torch.arange(N))
    return _Loop(
        DataLoader(data, batch_sampler=_PairsOfBatches(N)),
        DataLoader(data, batch_size=4),
        DataLoader(data, batch_size=5, shuffle=True),
    )


def _indices(loader: DataLoader[Any]) -> list[int]:
    return [int(i) for (batch,) in loader for i in batch]


def _sharded(world_size: int, epoch: int) -> list[dict[str, list[int]]]:
    shards = []
    for rank in range(world_size):
        loop = _loop()
        handler = DDPHandler(loop)
        handler.add_distributed_samplers(world_size, rank)
        loop.epoch = epoch
        loop.callbacks_handler.execute("on_epoch_begin")
        names = ("train_loader", "validation_loader", "test_loader")
        shards.append({name: _indices(getattr(loop, name)) for name in names})
    return shards


def test_every_loader_is_sharded_train_padded_evaluation_exact() -> None:
    shards = _sharded(3, epoch=0)
    train = [s["train_loader"] for s in shards]
    # 12 batches of 2 (the last of 1) over 3 ranks: 4 batches each, every batch exactly once.
    assert sorted(i for shard in train for i in shard) == list(range(N))
    for name in ("validation_loader", "test_loader"):
        everything = sorted(i for s in shards for i in s[name])
        assert everything == list(range(N)), f"{name}: each sample once, no padded duplicates"


def test_the_registered_callback_moves_every_sampler_to_the_epoch() -> None:
    epoch0, epoch1 = _sharded(2, epoch=0), _sharded(2, epoch=1)
    assert epoch0[0]["train_loader"] != epoch1[0]["train_loader"], "a new epoch, a new order"
    assert epoch0[0]["test_loader"] != epoch1[0]["test_loader"]
    assert epoch1 == _sharded(2, epoch=1), "an epoch's order depends on the epoch alone"
    loop = _loop()
    handler = DDPHandler(loop)
    handler.add_distributed_samplers(2, 0)
    assert loop.callbacks_handler.callbacks == [handler.callback]
    assert isinstance(handler.callback, DistributedSamplerSetEpoch)
    loop.epoch = 7
    loop.callbacks_handler.execute("on_epoch_begin")
    assert {s.epoch for s in handler.samplers.values()} == {7}
    assert set(handler.samplers) == {"train_loader", "validation_loader", "test_loader"}


def test_other_loader_arguments_survive_and_missing_loaders_are_skipped() -> None:
    data = TensorDataset(torch.arange(N))
    loop = _Loop(DataLoader(data, batch_size=4, drop_last=True, collate_fn=lambda rows: len(rows)), None, None)
    DDPHandler(loop).add_distributed_samplers(2, 1)
    assert isinstance(loop.train_loader.sampler, DistributedSampler)
    assert (loop.train_loader.batch_size, loop.train_loader.drop_last) == (4, True)
    assert list(loop.train_loader) == [4, 4, 4], "12 samples per rank (padded), collated by the user's function"
    assert loop.validation_loader is None


def test_build_loader_sampler_is_the_seeds_static_method() -> None:
    loader = DataLoader(TensorDataset(torch.arange(N)), batch_size=3)
    rebuilt, sampler = DDPHandler.build_loader_sampler(loader, False, 2, 1)
    assert isinstance(sampler, DistributedSampler)
    assert _indices(rebuilt) == [*range(1, N, 2), 0], "DistributedSampler's layout, padded"


def test_a_sampler_that_is_not_sharded_by_the_handler_is_kept() -> None:
    data = TensorDataset(torch.arange(N))
    own = DistributedSampler(data, num_replicas=2, rank=0)
    loop = _Loop(DataLoader(data, sampler=own), None, None)
    handler = DDPHandler(loop)
    handler.add_distributed_samplers(2, 0)
    assert handler.samplers == {"train_loader": own}


@pytest.mark.parametrize("rank", [-1, 2])
def test_a_rank_outside_the_world_is_refused(rank: int) -> None:
    with pytest.raises(ValueError, match=f"rank={rank} must be in \\[0, num_replicas=2\\)"):
        DDPHandler(_loop()).add_distributed_samplers(2, rank)


class _AitoolboxCallbacksHandler:
    """aitoolbox's handler: ``register_callbacks(callbacks, cache_callbacks=False, print_callbacks=False)``
    iterates over a list."""

    def __init__(self) -> None:
        self.registered: list[Any] = []

    def register_callbacks(self, callbacks: Any, cache_callbacks: bool = False, print_callbacks: bool = False) -> None:
        for callback in callbacks:
            self.registered.append(callback)


def test_the_callback_reaches_an_aitoolbox_callbacks_handler_as_a_list() -> None:
    loop = _loop()
    aitoolbox_handler = _AitoolboxCallbacksHandler()
    loop.callbacks_handler = aitoolbox_handler  # type: ignore[assignment]
    handler = DDPHandler(loop)
    handler.add_distributed_samplers(2, 1)
    assert aitoolbox_handler.registered == [handler.callback]
