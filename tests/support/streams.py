"""What several test modules share: streams."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset


class Numbers(IterableDataset[int]):
    """The stream ``0, 1, ..., length - 1``, in ``shards`` shards of consecutive numbers (or none)."""

    def __init__(self, length: int, shards: int | None = None) -> None:
        self.length, self.shards = length, shards
        if shards is not None:
            self.num_shards = shards

    def iter_shard(self, index: int) -> Iterator[int]:
        assert self.shards is not None
        size = -(-self.length // self.shards)
        return iter(range(index * size, min(self.length, (index + 1) * size)))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.length))


class _Sample(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """``(features, target)`` pairs whose first feature is the sample's number; two shards of unequal size."""

    num_shards = 2

    def __init__(self, sizes: tuple[int, int] = (40, 8)) -> None:
        self.sizes = sizes

    def iter_shard(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start = sum(self.sizes[:index])
        for number in range(start, start + self.sizes[index]):
            generator = torch.Generator().manual_seed(number)
            features = torch.randn(4, generator=generator)
            features[0] = number
            yield features, features[1:].sum().reshape(1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.num_shards):
            yield from self.iter_shard(index)


def _regression() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)
