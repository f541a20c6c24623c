"""What several test modules share: loaders."""

from __future__ import annotations

import inspect
import multiprocessing
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Sampler,
    TensorDataset,
)

DATA = TensorDataset(torch.arange(23))


def collate(batch: list[Any]) -> list[int]:
    return [int(item[0]) for item in batch]


def init_worker(worker_id: int) -> None:
    pass


class EveryThirdBatch(Sampler[list[int]]):
    """A custom batch sampler: batches of 3 consecutive indices, in reverse order."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return -(-self.n // 3)

    def __iter__(self) -> Any:
        batches = [list(range(i, min(i + 3, self.n))) for i in range(0, self.n, 3)]
        return iter(batches[::-1])


def rich_loader(**data: Any) -> DataLoader[Any]:
    """A loader with every non-default option set."""
    options: dict[str, Any] = {
        "num_workers": 2,
        "collate_fn": collate,
        "pin_memory": True,
        "timeout": 7.0,
        "worker_init_fn": init_worker,
        "multiprocessing_context": multiprocessing.get_context("spawn"),
        "generator": torch.Generator().manual_seed(3),
        "prefetch_factor": 3,
        "persistent_workers": True,
        "pin_memory_device": "cpu",
    }
    if "in_order" in inspect.signature(DataLoader.__init__).parameters:
        options["in_order"] = False
    return DataLoader(DATA, **{**options, **data})
