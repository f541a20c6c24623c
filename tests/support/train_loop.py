"""What several test modules share: train loop."""

from __future__ import annotations

import torch
from torch import nn


def _model(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 10))
