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

import hashlib
import struct

import torch

__all__ = ["batch_seed", "first_position", "share_sizes", "shares", "step_divisor"]


def shares(step: torch.Tensor, workers: int, worker: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Worker ``worker``'s batches of ``step`` (dataset indices) among ``workers``: the entries ``worker``,
    ``worker + workers``, ... in batches of ``batch_size``; none when the step has fewer items than ``worker + 1``
    (an epoch's last step, dealt over many workers)."""
    mine = step[worker::workers]
    return torch.split(mine, batch_size) if len(mine) else ()


def share_sizes(step_items: int, workers: int, worker: int, batch_size: int) -> list[int]:
    """The sizes of the batches :func:`shares` gives worker ``worker`` of ``workers`` in a step of ``step_items``
    items, worked out without the step's indices (no tensor operation)."""
    items = max(0, -(-(step_items - worker) // workers))  # len(range(worker, step_items, workers))
    full, rest = divmod(items, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def first_position(low: int, workers: int, worker: int, number: int, batch_size: int) -> int:
    """The entry of the epoch's global order that batch ``number`` (counted from ``low``) of ``worker``'s share
    begins with."""
    return low + worker + workers * number * batch_size


def batch_seed(seed: int, epoch: int, first: int) -> int:
    """The seed torch's random numbers get before the batch that begins at entry ``first`` of ``epoch``'s order: a
    63-bit hash (BLAKE2b, 8 bytes) of the loop's ``seed``, the epoch and the position, each taken modulo 2**64.

    Made for every batch, so it is a standard library hash of under a microsecond, not numpy's ``SeedSequence``
    (which the epochs' orders use, once an epoch), which takes tens of microseconds."""
    packed = struct.pack("<3Q", seed % 2**64, epoch % 2**64, first % 2**64)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8, person=b"ddpkit batch").digest(), "little") >> 1


def step_divisor(step_items: int, batch_items: int, workers: int) -> float:
    """What the loss of a batch of ``batch_items`` items, in a step of ``step_items`` items over ``workers``
    workers, is divided by: ``step_items / (batch_items * workers)``."""
    return step_items / (batch_items * workers)
