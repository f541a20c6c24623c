"""Seeding Python's, NumPy's and torch's random generators on every rank."""

from __future__ import annotations

import random

import numpy as np
import torch

from ddpkit.process_group._ranks import process_rank

__all__ = ["seed_everything"]


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device).

    Args:
        seed: in ``[0, 2**32)``.
        per_rank: add this process's global rank, so that ranks draw different
            numbers (e.g. for augmentation); the default gives every rank the same
            seed (e.g. for identical model initialisation).

    Returns:
        The seed used on this rank.

    Raises:
        ValueError: ``seed`` outside ``[0, 2**32)``.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    used = (seed + process_rank()) % 2**32 if per_rank else seed
    random.seed(used)
    np.random.seed(used)
    torch.manual_seed(used)
    return used
