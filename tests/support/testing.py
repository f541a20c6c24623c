"""What several test modules share: testing."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _placement(offset: int, *, scale: int = 1) -> tuple[int, int, float]:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank() + offset, dist.get_world_size(), total.item() * scale
