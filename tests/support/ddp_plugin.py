"""What several test modules share: ddp plugin."""

from __future__ import annotations

import torch


def data(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)) for _ in range(steps)]
