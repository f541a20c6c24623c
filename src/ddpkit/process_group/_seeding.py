"""Seeding Python's, NumPy's and torch's random generators on every rank."""

from __future__ import annotations

import random

import numpy as np
import torch

from ddpkit.process_group._ranks import process_rank

__all__ = ["reseed_torch", "seed_everything"]


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


def reseed_torch(seed: int) -> None:
    """Seed torch's CPU generator, and the CUDA devices' once CUDA is initialised: what ``torch.manual_seed``
    does, without its cost before CUDA starts (it formats a stack trace at every call, about 1 ms, to seed
    CUDA lazily). Meant for reseeding before every batch; seed once with :func:`seed_everything` first."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(seed)
