"""How a step's items are dealt over the workers that compute it, for DDP and fault tolerance alike.

The workers: every rank (DDP), or every rank of every replica group of the step's quorum (fault tolerance).
A step holds the entries ``[low, low + G)`` of the epoch's global order. Worker ``w`` of ``W`` takes the
entries ``low + w``, ``low + w + W``, ... (a distributed sampler's deal), in batches of ``batch_size``; batch
``n`` of its share begins at entry :func:`first_position`. Each batch's random numbers (dropout) are seeded from
that position (:func:`batch_seed`), so whoever computes a batch, after any resize or recovery, draws the same
numbers. Each batch's loss, a mean over its items, is divided by :func:`step_divisor`, so that the mean of the
workers' gradients is the mean over the step's items, as one process with a batch of ``G`` items computes it.
"""

from __future__ import annotations

import torch

from ddpkit.samplers import epoch_seed

__all__ = ["batch_seed", "first_position", "shares", "step_divisor"]


def shares(step: torch.Tensor, workers: int, worker: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Worker ``worker``'s batches of ``step`` (dataset indices) among ``workers``: the entries ``worker``,
    ``worker + workers``, ... in batches of ``batch_size``."""
    return torch.split(step[worker::workers], batch_size)


def first_position(low: int, workers: int, worker: int, number: int, batch_size: int) -> int:
    """The entry of the epoch's global order that batch ``number`` (counted from ``low``) of ``worker``'s share
    begins with."""
    return low + worker + workers * number * batch_size


def batch_seed(seed: int, epoch: int, first: int) -> int:
    """The seed torch's random numbers get before the batch that begins at entry ``first`` of ``epoch``'s order
    (a hash of the loop's ``seed``, the epoch and the position)."""
    return epoch_seed(seed, epoch, first)


def step_divisor(step_items: int, batch_items: int, workers: int) -> float:
    """What the loss of a batch of ``batch_items`` items, in a step of ``step_items`` items over ``workers``
    workers, is divided by: ``step_items / (batch_items * workers)``."""
    return step_items / (batch_items * workers)
