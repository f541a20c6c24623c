"""What several test modules share: launch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _report(offset: int, weights: torch.Tensor, *, scale: int) -> dict[str, object]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    weights.add_(dist.get_rank() + 1)  # each rank's own copy: nothing shared behind DDP's back
    dist.barrier()
    return {
        "weights": weights.tolist(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": total.item() * scale + offset,
        "threads": torch.get_num_threads(),
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
