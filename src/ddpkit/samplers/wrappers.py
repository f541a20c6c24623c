"""``DistributedSamplerWrapper``: any sampler or batch sampler sharded across ranks (OML's
``DDPSamplerWrapper`` builds on it in :mod:`ddpkit.samplers.oml`).

It combines the epoch's order (:mod:`ddpkit.samplers.order`: the wrapped
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
from ddpkit.process_group import collective_device, ensure_dist_connection, get_rank, get_world_size, is_distributed
from ddpkit.samplers.layout import EpochLayout, Tail, tail_of
from ddpkit.samplers.order import Order, check_same_order, draw_order, epoch_seed, forward_epoch

__all__ = ["DistributedSamplerWrapper"]


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
        num_replicas: number of ranks; default the process group's world size
            (created first if a launcher started this process as one of
            several ranks, see :func:`~ddpkit.ensure_dist_connection`), or 1.
        rank: this rank; default the process group's rank, or 0.
        shuffle: also shuffle the entries' positions between ranks (a local
            generator seeded with ``seed + epoch``, as ``DistributedSampler``; the
            global RNG is not touched).
        seed: seeds the position shuffle and, through ``epoch_seed``, the
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
    wrapper does). :meth:`set_position` resumes an epoch part-way, on any number
    of ranks, without touching the data already used.

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
        if num_replicas is None or rank is None:
            ensure_dist_connection()  # a launcher's rank without its group yet: make it, never assume one process
        replicas = get_world_size() if num_replicas is None else num_replicas
        this_rank = get_rank() if rank is None else rank
        if replicas < 1 or not 0 <= this_rank < replicas:
            raise ValueError(f"rank={this_rank} must be in [0, num_replicas={replicas}) with num_replicas >= 1")
        # DistributedSampler's attributes, set directly: the wrapped sampler is not a dataset.
        self.dataset = sampler  # type: ignore[assignment]
        self.sampler = sampler
        self.num_replicas = replicas
        self.rank = this_rank
        #: Whether ``num_replicas`` and ``rank`` were left to default (a ``TrainLoop`` then places the sampler
        #: in the rank that trains with it, wherever it was built).
        self.default_placement = num_replicas is None and rank is None
        self.epoch = 0
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.even_shards = even_shards
        self.check_order = check_order
        self._epoch_given = False
        self._iterated = False
        self._position = 0
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

        The same as :meth:`set_position` with ``start * num_replicas``: every
        rank has done ``start`` entries of this world size's layout.

        Raises:
            ValueError: ``start`` is negative.
        """
        if start < 0:
            raise ValueError(f"start={start} must be >= 0")
        self.set_position(start * self.num_replicas)

    def set_position(self, position: int) -> None:
        """Make the next iteration deal out only the entries from ``position`` on of the epoch's global order.

        ``position`` counts entries (indices, or whole batches of a batch
        sampler) of all ranks together, so it does not depend on the world
        size: a run resized part-way through an epoch resumes exactly the
        entries not used yet, position ``position + k`` to rank ``k % W``.
        Nothing before it is yielded, so a DataLoader never loads it. Applies
        to one iteration; the epoch does not advance for it.

        Raises:
            ValueError: ``position`` is negative.
        """
        if position < 0:
            raise ValueError(f"position={position} must be >= 0")
        self._position = position
        self._epoch_given = True

    def state_dict(self) -> dict[str, int]:
        """``{"epoch": ..., "seed": ...}`` of the current epoch (add ``"position"`` to resume part-way)."""
        return {"epoch": self.epoch, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`, plus an optional ``"position"`` (entries of all ranks already
        done, :meth:`set_position`) or ``"start"`` (entries of this rank already done, :meth:`set_start`)."""
        self.seed = int(state.get("seed", self.seed))
        self.set_epoch(int(state["epoch"]))
        if state.get("position"):
            self.set_position(int(state["position"]))
        elif state.get("start"):
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

    def _layout_of_length(self, start: int = 0) -> EpochLayout:
        return EpochLayout(self.entry_count, self.num_replicas, self.mode, start=start)

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
        return self._layout_of_length(self._position).shard_length(self.rank)

    @property
    def entry_count(self) -> int:
        """Entries (indices, or batches) the wrapped sampler produces per epoch."""
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
        start, self._position = self._position, 0
        order = self._epoch_order(epoch)
        permutation = None
        if self.shuffle and len(order):  # DistributedSampler's own shuffle of the positions
            permutation = torch.randperm(len(order), generator=torch.Generator().manual_seed(self.seed + epoch))
        self._layout = EpochLayout(
            len(order), self.num_replicas, self.mode, permutation, order.batch_sizes(), start=start
        )
        return iter(order.select(self._layout.entry_indices(self.rank)))

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
