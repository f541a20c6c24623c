"""OML's ``DDPSamplerWrapper``: a :class:`~ddpkit.DistributedSamplerWrapper` seeded from the user's RNG."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ddpkit._compat import override
from ddpkit.samplers.wrappers import DistributedSamplerWrapper

__all__ = ["DDPSamplerWrapper"]


class DDPSamplerWrapper(DistributedSamplerWrapper):
    """OML's ``DDPSamplerWrapper``: custom samplers and batch samplers in DDP mode.

    ``DDPSamplerWrapper(sampler, shuffle_samples_between_gpus=True,
    pad_data_to_num_gpus=True)`` distributes the indices (or batches) the
    sampler produces among the ranks of the process group: a
    :class:`DistributedSamplerWrapper` with ``shuffle=shuffle_samples_between_gpus``
    and ``drop_last=not pad_data_to_num_gpus``.

    Args:
        sampler: sequential, random, or batch sampler.
        shuffle_samples_between_gpus: shuffle the available entries before
            feeding them to the ranks; the sampler's own order inside is kept.
        pad_data_to_num_gpus: pad so every rank gets the same number of entries
            (``True``), or discard the tail (``False``).

    The wrapped sampler's randomness follows the user's seeding: at the first
    epoch a base seed is drawn from torch's global generator (as ``DataLoader``
    draws its own), rank 0's is shared with every rank (one broadcast), and
    every epoch, epoch 0 included, runs the sampler with the RNGs seeded from
    that base and the epoch (each iteration advances the epoch, as OML's
    ``_reload``). The same user seed gives the same epochs, and no epoch
    repeats another. Unlike OML, epoch 0 is not drawn from the global RNG as it
    stands (ranks seeded differently would disagree), and ranks whose sampler
    still draws different orders raise instead of losing and repeating items.

    Attributes:
        base_seed: the base seed, ``None`` until the first iteration (it is in
            :meth:`state_dict`, so a resumed run keeps it).
    """

    def __init__(
        self, sampler: Iterable[Any], shuffle_samples_between_gpus: bool = True,
        pad_data_to_num_gpus: bool = True,
    ) -> None:  # fmt: skip
        super().__init__(sampler, shuffle=shuffle_samples_between_gpus, drop_last=not pad_data_to_num_gpus)
        self.seed_shift_per_epoch = 0
        self.base_seed: int | None = None

    def _reload(self) -> None:
        """Move to the next epoch: ``epoch = seed_shift_per_epoch`` (0, 1, 2, ...), as OML's ``_reload`` (which
        also re-read the sampler from epoch 1 on; this wrapper re-reads it every epoch anyway)."""
        self.set_epoch(self.seed_shift_per_epoch)
        self.seed_shift_per_epoch += 1

    @override
    def __iter__(self) -> Iterator[Any]:
        if not self._epoch_given:
            self._reload()
        return super().__iter__()

    @override
    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "seed", "base_seed"}`` (``base_seed`` once the first epoch has drawn it)."""
        state = super().state_dict()
        if self.base_seed is not None:
            state["base_seed"] = self.base_seed
        return state

    @override
    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`: the epoch, and the base seed of the run it came from."""
        if "base_seed" in state:
            self.base_seed = int(state["base_seed"])
        super().load_state_dict(state)
        self.seed_shift_per_epoch = self.epoch + 1  # the epoch after the resumed one

    @override
    def _base_seed(self) -> int:
        """Drawn from torch's global generator at the first epoch; rank 0's, on every rank."""
        if self.base_seed is None:
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            shared = self._rank_zero_value(drawn)
            self.base_seed = drawn if shared is None else shared
        return self.base_seed
