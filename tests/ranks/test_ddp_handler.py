"""aitoolbox's DDPHandler: all three loaders sharded (custom batch samplers too), epochs kept right, mp_sync.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_ddp_handler.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit import DDPHandler
from ddpkit.testing import run_parallel


def _sync() -> tuple[torch.Tensor, list[float], dict[str, Any]]:
    handler = DDPHandler(None)
    rank = dist.get_rank()
    tensor = handler.mp_sync(torch.tensor([rank, rank * 10]))
    numbers = handler.mp_sync([0.5 + rank], return_tensor=False)
    merged = handler.mp_sync_dict({"loss": [float(rank)], "ids": torch.tensor([rank])})
    return tensor, numbers, merged


def test_mp_sync_and_mp_sync_dict_give_every_rank_everything() -> None:
    results = run_parallel(_sync, world_size=2)
    for tensor, numbers, merged in results:
        assert tensor.tolist() == [0, 0, 1, 10]
        assert numbers == [0.5, 1.5]
        assert merged["loss"].tolist() == [0.0, 1.0]
        assert merged["ids"].tolist() == [0, 1]
