"""The public wrappers: ``DistributedSamplerWrapper`` and OML's ``DDPSamplerWrapper``.

They combine the epoch's order (:mod:`ddpkit.samplers.order`: the wrapped
sampler run the same way on every rank) with the layout
(:mod:`ddpkit.samplers.layout`: which positions go to which rank, and the
tail), and keep ``DistributedSampler``'s interface: ``set_epoch``,
``num_samples``, ``total_size``, ``len()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from ddpkit._compat import override
from ddpkit.process_group import collective_device, get_rank, get_world_size, is_distributed
from ddpkit.samplers.layout import EpochLayout, Tail, tail_of
from ddpkit.samplers.order import Order, check_same_order, draw_order, epoch_seed, forward_epoch

__all__ = ["DDPSamplerWrapper", "DistributedSamplerWrapper"]


class DistributedSamplerWrapper(DistributedSampler):  # type: ignore[type-arg]
    """Shard ANY sampler or batch sampler across ranks, every epoch, the same way on every rank.

    A ``torch.utils.data.DistributedSampler`` subclass: use it as ``sampler=`` for
    an item sampler, or ``batch_sampler=`` for a batch sampler (batches are kept
    whole). Every epoch the wrapped sampler is iterated once, so its own
    randomness is honoured, then its entries (indices, or whole batches) are
    dealt out: entry position ``p`` to rank ``p % W``, as ``DistributedSampler``
    does, so ``W`` ranks with batch ``B`` step through the batches of one process
    with batch ``W * B``. The ranks always agree on the order: the wrapped
    sampler runs with the global RNGs and its ``None`` generators seeded from
    ``seed`` and the epoch (and restored afterwards); other randomness is caught
    by a checksum compared across ranks.

    Args:
        sampler: any sampler (yields indices) or batch sampler (yields lists of
            indices) with ``__len__``.
        num_replicas: number of ranks; default the process group's world size, or 1.
        rank: this rank; default the process group's rank, or 0.
        shuffle: also shuffle the entries' positions between ranks (a local
            generator seeded with ``seed + epoch``, as ``DistributedSampler``; the
            global RNG is not touched).
        seed: seeds the position shuffle and, through :func:`epoch_seed`, the
            wrapped sampler's randomness (as ``DistributedSampler``'s ``seed``,
            the order does not depend on the global RNG).
        drop_last: drop the tail so all ranks get ``len // W`` entries.
        even_shards: pad the tail by repeating from the start, so all ranks get
            ``ceil(len / W)`` entries (default); ``False`` leaves them uneven by at
            most one entry, with no duplicates. Ignored with ``drop_last``.
        check_order: compare a checksum of each epoch's order across ranks (one
            2-element ``all_reduce`` per epoch, only for samplers whose
            randomness ddpkit cannot seed).

    Epochs advance by themselves: iterating again without :meth:`set_epoch` moves
    to the next epoch; an explicit ``set_epoch`` wins. The epoch is passed on to
    the wrapped sampler's own ``set_epoch``, if it has one (as Lightning's
    wrapper does). :meth:`set_start` resumes an epoch part-way without touching
    the skipped data.

    Iterating may run collectives (with a process group of ``num_replicas``
    ranks): the order checksum and, for :class:`DDPSamplerWrapper`, a broadcast
    of the base seed at the first epoch. Every rank must then iterate the
    sampler, as DDP training does; iterating on one rank alone would wait.

    Raises:
        ValueError: ``num_replicas < 1`` or ``rank`` outside ``[0, num_replicas)``.
        TypeError: the wrapped sampler has no ``__len__``.
        CollectiveMismatchError: (when iterating) the wrapped sampler produced a
            different order on different ranks; the message says how to fix it.
    """

    def __init__(
        self,
        sampler: Iterable[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        even_shards: bool = True,
        check_order: bool = True,
    ) -> None:
        if not hasattr(sampler, "__len__"):
            raise TypeError(
                f"{type(sampler).__name__} has no __len__; DistributedSamplerWrapper needs to size the shards"
            )
        replicas = get_world_size() if num_replicas is None else num_replicas
        this_rank = get_rank() if rank is None else rank
        if replicas < 1 or not 0 <= this_rank < replicas:
            raise ValueError(f"rank={this_rank} must be in [0, num_replicas={replicas}) with num_replicas >= 1")
        # DistributedSampler's attributes, set directly: the wrapped sampler is not a dataset.
        self.dataset = sampler  # type: ignore[assignment]
        self.sampler = sampler
        self.num_replicas = replicas
        self.rank = this_rank
        self.epoch = 0
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.even_shards = even_shards
        self.check_order = check_order
        self._epoch_given = False
        self._iterated = False
        self._start = 0
        self._layout: EpochLayout | None = None

    # --- epochs ---------------------------------------------------------------------------------

    @override
    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (instead of advancing by one); the wrapped sampler's
        ``set_epoch(epoch)`` is called too, if it has one."""
        self.epoch = epoch
        self._epoch_given = True
        forward_epoch(self.sampler, epoch)

    def set_start(self, start: int) -> None:
        """Make the next iteration resume this rank's shard at entry ``start`` (of the current epoch).

        Nothing before ``start`` is yielded, so a DataLoader never loads it. Applies
        to one iteration; the epoch does not advance for it.

        Raises:
            ValueError: ``start`` is negative.
        """
        if start < 0:
            raise ValueError(f"start={start} must be >= 0")
        self._start = start
        self._epoch_given = True

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "seed": ...}`` of the current epoch (add ``"start"`` to resume part-way)."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` (plus an optional ``"start"``: entries of this rank already done)."""
        self.seed = int(state.get("seed", self.seed))
        self.set_epoch(int(state["epoch"]))
        if state.get("start"):
            self.set_start(int(state["start"]))

    def _next_epoch(self) -> int:
        if self._iterated and not self._epoch_given:
            self.epoch += 1
        self._iterated, self._epoch_given = True, False
        return self.epoch

    # --- sizes ------------------------------------------------------------------------------------

    @property
    def mode(self) -> Tail:
        """``"drop"``, ``"pad"`` or ``"uneven"``: what ``drop_last`` and ``even_shards`` make of the tail."""
        return tail_of(self.drop_last, self.even_shards)

    def _layout_of_length(self) -> EpochLayout:
        return EpochLayout(self._entry_count(), self.num_replicas, self.mode)

    @property
    def num_samples(self) -> int:
        """Entries this rank yields per epoch (``DistributedSampler``'s attribute)."""
        return self._layout_of_length().shard_length(self.rank)

    @num_samples.setter
    def num_samples(self, value: int) -> None:  # DistributedSampler.__init__ would set it; ours is derived
        pass

    @property
    def total_size(self) -> int:
        """Entries over all ranks per epoch, padding included (``DistributedSampler``'s attribute)."""
        return self._layout_of_length().total_positions()

    @total_size.setter
    def total_size(self, value: int) -> None:
        pass

    @override
    def __len__(self) -> int:
        return max(0, self.num_samples - self._start)

    def _entry_count(self) -> int:
        """Entries the wrapped sampler produces per epoch."""
        return len(self.sampler)  # type: ignore[arg-type]  # checked in __init__

    @property
    def last_layout(self) -> EpochLayout | None:
        """The layout of the most recent epoch this sampler produced (``None`` before the first)."""
        return self._layout

    # --- iterating --------------------------------------------------------------------------------

    @override
    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch()
        forward_epoch(self.sampler, epoch)
        start, self._start = self._start, 0
        order = self._epoch_order(epoch)
        permutation = None
        if self.shuffle and len(order):  # DistributedSampler's own shuffle of the positions
            permutation = torch.randperm(len(order), generator=torch.Generator().manual_seed(self.seed + epoch))
        self._layout = EpochLayout(len(order), self.num_replicas, self.mode, permutation, order.batch_sizes())
        return iter(order.select(self._layout.entry_indices(self.rank)[start:]))

    def _epoch_order(self, epoch: int) -> Order:
        """The wrapped sampler's entries for ``epoch``, the same on every rank (checked where not certain)."""
        seed = functools.cache(lambda: epoch_seed(self._base_seed(), epoch))  # drawn only if randomness needs it
        order = draw_order(self.sampler, seed)
        if self.check_order and not order.seeding.by_ddpkit:
            check_same_order(order, self.num_replicas, epoch)
        return order

    def _base_seed(self) -> int:
        """The base of every epoch's seed for the wrapped sampler's randomness: ``seed``."""
        return self.seed

    def _rank_zero_value(self, value: int) -> int | None:
        """Rank 0's ``value`` on every rank (one broadcast), or ``None`` when the ranks cannot be reached."""
        if not is_distributed() or self.num_replicas != get_world_size():
            return None if self.num_replicas > 1 else value
        shared = torch.tensor([value], dtype=torch.int64, device=collective_device())
        dist.broadcast(shared, src=0)
        return int(shared.item())


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
    :meth:`_reload`). The same user seed gives the same epochs, and no epoch
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
