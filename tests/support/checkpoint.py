"""What several test modules share: checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _state(step: int) -> dict[str, Any]:
    return {"step": step, "weights": torch.full((5000,), float(step)), "nested": {"names": ["a", "b"]}}


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "last.pt")
