"""Shard any sampler or batch sampler across ranks: ``DistributedSamplerWrapper`` and ``DDPSamplerWrapper``.

Three concepts, one module each: :mod:`~ddpkit.samplers.layout` (which
positions go to which rank, and the tail: pad, drop or uneven),
:mod:`~ddpkit.samplers.order` (the wrapped sampler's epoch, drawn the same way
on every rank) and the public classes, :mod:`~ddpkit.samplers.wrappers` and
OML's in :mod:`~ddpkit.samplers.oml`.
"""

from __future__ import annotations

from ddpkit.samplers.layout import EpochLayout, Tail
from ddpkit.samplers.oml import DDPSamplerWrapper
from ddpkit.samplers.order import epoch_seed
from ddpkit.samplers.wrappers import DistributedSamplerWrapper

__all__ = ["DDPSamplerWrapper", "DistributedSamplerWrapper", "EpochLayout", "Tail", "epoch_seed"]
