"""What several test modules share: samplers."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Sampler


class GlobalRandomSampler(Sampler[int]):
    """Draws from torch's global RNG, as many custom samplers do."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(torch.randperm(self.n).tolist())
