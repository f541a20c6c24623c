"""Shard any sampler or batch sampler across ranks (layer 4): ``DistributedSamplerWrapper``, ``DDPSamplerWrapper``.

Layout: the wrapped sampler's epoch is a sequence of entries (indices, or whole
batches for a batch sampler); entry position ``p`` goes to rank ``p % W`` --
``DistributedSampler``'s layout, so ``W`` ranks with batch ``B`` step through the
batches of one process with batch ``W * B``. The tail is padded by repeating
from the start (``even_shards=True``), dropped (``drop_last=True``), or left
uneven by at most one entry (``even_shards=False``: no duplicates, for exact
evaluation with :func:`~ddpkit.gather_in_order`).

The ranks always agree on the order: the wrapped sampler runs with the global
RNGs (torch, numpy, ``random``) forked and seeded with the epoch's seed (and
restored afterwards), and a sampler whose ``generator`` is ``None`` gets one
seeded the same way. The epoch's seed is :func:`epoch_seed` of a base seed and
the epoch: a hash, so no two (base, epoch) pairs share a seed (``seed + epoch``
would make epoch 1 of seed 0 equal to epoch 0 of seed 1). A sampler with
randomness of its own that ddpkit cannot reach is caught by comparing a
checksum of the epoch's order across ranks.
"""

from __future__ import annotations

import array
import contextlib
import functools
import itertools
import random
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

from ddpkit.errors import CollectiveMismatchError
from ddpkit.process_group import get_rank, get_world_size, is_distributed

__all__ = ["DDPSamplerWrapper", "DistributedSamplerWrapper", "EpochLayout", "epoch_seed"]

Mode = Literal["pad", "drop", "uneven"]


def epoch_seed(base: int, epoch: int) -> int:
    """The seed of ``epoch`` for a run with base seed ``base``: a 63-bit hash of both (numpy's ``SeedSequence``).

    Different (base, epoch) pairs give unrelated seeds, so neither two epochs of
    one run nor two runs with different base seeds repeat an order by accident.
    """
    (state,) = np.random.SeedSequence([base % 2**64, epoch % 2**64]).generate_state(1, np.uint64)
    return int(state) >> 1


@dataclass(frozen=True)
class EpochLayout:
    """How one epoch was sharded: enough to map every rank's items back to the wrapped order.

    Attributes:
        entries: number of entries (items, or batches) the wrapped sampler produced.
        world_size: number of ranks.
        mode: ``"pad"`` (tail padded from the start), ``"drop"`` (tail dropped) or
            ``"uneven"`` (ranks differ by at most one entry).
        permutation: the position shuffle (entry at shuffled position ``p`` is
            ``permutation[p]``), or ``None``.
        batch_sizes: items in each entry for a batch sampler (int64, ``(entries,)``),
            ``None`` for an item sampler.
    """

    entries: int
    world_size: int
    mode: Mode
    permutation: torch.Tensor | None = None
    batch_sizes: torch.Tensor | None = None

    def total_positions(self) -> int:
        """Positions over all ranks: padded up, dropped down, or exactly ``entries``."""
        n, w = self.entries, self.world_size
        if self.mode == "pad":
            return -(-n // w) * w if n else 0
        if self.mode == "drop":
            return n // w * w
        return n

    def rank_entries(self, rank: int) -> torch.Tensor:
        """Entry indices (into the wrapped order) that ``rank`` gets, in its iteration order (int64)."""
        positions = self._positions(rank)
        if self.entries:
            positions = positions % self.entries
        return self.permutation[positions] if self.permutation is not None else positions

    def rank_items(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, first)`` for each item ``rank`` yields, in order.

        ``positions`` are item positions in the wrapped sampler's flattened order;
        ``first`` is false for the padded repeats (duplicates of earlier positions).
        """
        first = self._positions(rank) < self.entries
        entries = self.rank_entries(rank)
        if self.batch_sizes is None:
            return entries, first
        offsets = torch.cumsum(self.batch_sizes, 0) - self.batch_sizes
        sizes = self.batch_sizes[entries]
        starts = torch.repeat_interleave(offsets[entries] - torch.cumsum(sizes, 0) + sizes, sizes)
        items = torch.arange(int(sizes.sum()), dtype=torch.int64) + starts
        return items, torch.repeat_interleave(first, sizes)

    def _positions(self, rank: int) -> torch.Tensor:
        """Layout positions ``rank, rank + W, ...`` below the total (empty when there are fewer)."""
        return torch.arange(rank, max(rank, self.total_positions()), self.world_size, dtype=torch.int64)

    def items(self) -> int:
        """Items (not entries) in the wrapped sampler's epoch."""
        return self.entries if self.batch_sizes is None else int(self.batch_sizes.sum())


class DistributedSamplerWrapper(DistributedSampler):  # type: ignore[type-arg]
    """Shard ANY sampler or batch sampler across ranks, every epoch, the same way on every rank.

    A ``torch.utils.data.DistributedSampler`` subclass: use it as ``sampler=`` for
    an item sampler, or ``batch_sampler=`` for a batch sampler (batches are kept
    whole). Every epoch the wrapped sampler is iterated once, so its own
    randomness is honoured, then its entries are sharded as the module docstring
    describes.

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
            2-element ``all_reduce`` per epoch, only with a process group and only
            for samplers whose randomness ddpkit cannot seed); every rank must then
            iterate the sampler, as DDP training does.

    Epochs advance by themselves: iterating again without :meth:`set_epoch` moves
    to the next epoch; an explicit ``set_epoch`` wins. The epoch is passed on to
    the wrapped sampler's own ``set_epoch``, if it has one (as Lightning's
    wrapper does). :meth:`set_start` resumes an epoch part-way without touching
    the skipped data.

    Iterating may run collectives (only with a process group whose size is
    ``num_replicas``): the order checksum (see ``check_order``) and, for
    :class:`DDPSamplerWrapper`, one broadcast of the base seed at the first
    epoch. Every rank must then iterate the sampler, as DDP training does;
    iterating it on one rank alone would wait for the others.

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

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (instead of advancing by one); the wrapped sampler's
        ``set_epoch(epoch)`` is called too, if it has one."""
        self.epoch = epoch
        self._epoch_given = True
        _forward_epoch(self.sampler, epoch)

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
    def mode(self) -> Mode:
        """``"drop"``, ``"pad"`` or ``"uneven"``: what happens to the tail."""
        if self.drop_last:
            return "drop"
        return "pad" if self.even_shards else "uneven"

    def _shard_length(self, entries: int) -> int:
        w, r = self.num_replicas, self.rank
        if self.mode == "drop":
            return entries // w
        if self.mode == "pad":
            return -(-entries // w)
        return max(0, -(-(entries - r) // w))

    @property
    def num_samples(self) -> int:
        """Entries this rank yields per epoch (``DistributedSampler``'s attribute)."""
        return self._shard_length(self._entries())

    @num_samples.setter
    def num_samples(self, value: int) -> None:  # DistributedSampler.__init__ would set it; ours is derived
        pass

    @property
    def total_size(self) -> int:
        """Entries over all ranks per epoch, padding included (``DistributedSampler``'s attribute)."""
        return EpochLayout(self._entries(), self.num_replicas, self.mode).total_positions()

    @total_size.setter
    def total_size(self, value: int) -> None:
        pass

    def __len__(self) -> int:
        return max(0, self.num_samples - self._start)

    def _entries(self) -> int:
        """Entries the wrapped sampler produces per epoch."""
        return len(self.sampler)  # type: ignore[arg-type]  # checked in __init__

    @property
    def last_layout(self) -> EpochLayout | None:
        """The layout of the most recent epoch this sampler produced (``None`` before the first)."""
        return self._layout

    # --- iterating --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        epoch = self._next_epoch()
        _forward_epoch(self.sampler, epoch)
        start, self._start = self._start, 0
        order = self._epoch_order(epoch)
        permutation = None
        if self.shuffle and len(order):
            permutation = torch.randperm(len(order), generator=torch.Generator().manual_seed(self.seed + epoch))
        sizes = order.batch_sizes()
        self._layout = EpochLayout(len(order), self.num_replicas, self.mode, permutation, sizes)
        entries = self._layout.rank_entries(self.rank)[start:]
        return iter(order.select(entries))

    def _epoch_order(self, epoch: int) -> _Order:
        """The wrapped sampler's entries for ``epoch``, the same on every rank (checked where not certain)."""
        seed = functools.cache(lambda: epoch_seed(self._base_seed(), epoch))  # drawn only if randomness needs it
        fast = _fast_order(self.sampler, seed)
        if fast is not None:
            order: _Order = fast
            certain, user_generators = fast.seeded_by_us, not fast.seeded_by_us
        else:
            with _seeded(self.sampler, seed()) as user_generators:
                order = _ListOrder(list(iter(self.sampler)))
            certain = False
        if self.check_order and not certain:
            _check_same_order(order, self.num_replicas, epoch, user_generators)
        return order

    def _base_seed(self) -> int:
        """The base of every epoch's seed for the wrapped sampler's randomness: ``seed``."""
        return self.seed

    def _rank_zero_value(self, value: int) -> int | None:
        """Rank 0's ``value`` on every rank (one broadcast), or ``None`` when the ranks cannot be reached."""
        if not is_distributed() or self.num_replicas != get_world_size():
            return None if self.num_replicas > 1 else value
        shared = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            shared = shared.cuda()
        dist.broadcast(shared, src=0)
        return int(shared.item())


class DDPSamplerWrapper(DistributedSamplerWrapper):
    """OML's wrapper for custom samplers in DDP mode (seeds 001 and 004).

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
    draws its base seed), rank 0's is shared with every rank (one broadcast),
    and every epoch, epoch 0 included, runs the sampler with the global RNGs
    seeded with :func:`epoch_seed` of that base and the epoch (each new
    iteration advances the epoch, as :meth:`_reload` did in OML). So the same
    user seed gives the same epochs, another seed other epochs, and no epoch
    repeats another. Unlike OML, epoch 0 is not drawn from the global RNG as it
    stands (where ranks seeded differently would disagree), and ranks whose
    sampler still draws a different order raise instead of silently losing and
    duplicating items.

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
        """Move to the next epoch: ``epoch = seed_shift_per_epoch`` (0, 1, 2, ...), as OML's ``_reload``.

        OML re-read the sampler here from epoch 1 on; this wrapper re-reads it every
        epoch anyway. Called by ``__iter__``.
        """
        self.set_epoch(self.seed_shift_per_epoch)
        self.seed_shift_per_epoch += 1

    def __iter__(self) -> Iterator[Any]:
        if not self._epoch_given:
            self._reload()
        return super().__iter__()

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "seed", "base_seed"}`` (``base_seed`` once the first epoch has drawn it)."""
        state = super().state_dict()
        if self.base_seed is not None:
            state["base_seed"] = self.base_seed
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`: the epoch, and the base seed of the run it came from."""
        if "base_seed" in state:
            self.base_seed = int(state["base_seed"])
        super().load_state_dict(state)
        self.seed_shift_per_epoch = self.epoch + 1  # the epoch after the resumed one

    def _base_seed(self) -> int:
        """Drawn from torch's global generator at the first epoch; rank 0's, on every rank."""
        if self.base_seed is None:
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            shared = self._rank_zero_value(drawn)
            self.base_seed = drawn if shared is None else shared
        return self.base_seed


# --- the wrapped sampler's order --------------------------------------------------------------------


class _Order:
    """One epoch of the wrapped sampler: entries that a rank selects from."""

    def __len__(self) -> int:
        raise NotImplementedError

    def checksum(self) -> int:
        """A CRC-32 of the order, identical across processes for identical orders."""
        raise NotImplementedError

    def batch_sizes(self) -> torch.Tensor | None:
        raise NotImplementedError

    def select(self, entries: torch.Tensor) -> list[Any]:
        raise NotImplementedError


class _ListOrder(_Order):
    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries
        self.batched = bool(entries) and isinstance(entries[0], (list, tuple))

    def __len__(self) -> int:
        return len(self.entries)

    def batch_sizes(self) -> torch.Tensor | None:
        if not self.batched:
            return None
        return torch.tensor([len(batch) for batch in self.entries], dtype=torch.int64)

    def select(self, entries: torch.Tensor) -> list[Any]:
        items = self.entries
        return [items[e] for e in entries.tolist()]

    def checksum(self) -> int:
        flat = itertools.chain.from_iterable(self.entries) if self.batched else self.entries
        try:
            data = array.array("q", flat).tobytes()
        except (TypeError, OverflowError):  # not integers: compare their text
            data = repr(self.entries).encode()
        sizes = self.batch_sizes()
        crc = zlib.crc32(data)
        return zlib.crc32(sizes.numpy().tobytes(), crc) if sizes is not None else crc


class _TensorOrder(_Order):
    """Indices as a tensor, and optionally batches as (start, size) runs of it: no Python list of N items."""

    def __init__(
        self, indices: torch.Tensor, seeded_by_us: bool, batch_size: int | None = None, drop_last: bool = False
    ) -> None:
        self.indices = indices
        self.seeded_by_us = seeded_by_us
        self.batch_size = batch_size
        self.count = len(indices) if batch_size is None else (
            len(indices) // batch_size if drop_last else -(-len(indices) // batch_size))  # fmt: skip

    def __len__(self) -> int:
        return self.count

    def batch_sizes(self) -> torch.Tensor | None:
        if self.batch_size is None:
            return None
        sizes = torch.full((self.count,), self.batch_size, dtype=torch.int64)
        if self.count and self.count * self.batch_size > len(self.indices):
            sizes[-1] = len(self.indices) - (self.count - 1) * self.batch_size
        return sizes

    def checksum(self) -> int:
        return zlib.crc32(self.indices.numpy().tobytes(), self.batch_size or 0)

    def select(self, entries: torch.Tensor) -> list[Any]:
        if self.batch_size is None:
            return list(self.indices[entries].tolist())
        b, flat = self.batch_size, self.indices
        return [flat[e * b : (e + 1) * b].tolist() for e in entries.tolist()]


def _fast_order(sampler: Any, seed: Callable[[], int]) -> _TensorOrder | None:
    """The exact order of a stock ``SequentialSampler``, ``RandomSampler`` (no replacement) or a
    ``BatchSampler`` of one, computed as a tensor; ``None`` for any other sampler.

    A ``RandomSampler`` without a generator draws from a generator seeded with ``seed()``.
    """
    kind = type(sampler)
    if kind is BatchSampler:
        inner = _fast_order(sampler.sampler, seed)
        if inner is None or inner.batch_size is not None:
            return None
        return _TensorOrder(inner.indices, inner.seeded_by_us, sampler.batch_size, sampler.drop_last)
    if kind is SequentialSampler:
        return _TensorOrder(torch.arange(len(sampler.data_source), dtype=torch.int64), True)
    if kind is RandomSampler and not sampler.replacement:
        n, count = len(sampler.data_source), sampler.num_samples
        ours = sampler.generator is None
        generator = torch.Generator().manual_seed(seed()) if ours else sampler.generator
        # As RandomSampler.__iter__ draws: one permutation per full pass, then one for the rest.
        parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
        parts.append(torch.randperm(n, generator=generator)[: count % n])
        return _TensorOrder(torch.cat(parts) if len(parts) > 1 else parts[0], ours)
    return None


@contextlib.contextmanager
def _seeded(sampler: Any, seed: int) -> Iterator[bool]:
    """Run the sampler with its ``generator`` attributes (where ``None``) and the global RNGs (torch, numpy,
    ``random``) seeded from ``seed``; restore everything after. Yields whether it holds generators of the
    user's own."""
    holders = _generator_holders(sampler)
    own = any(getattr(h, "generator", None) is not None for h in holders)
    empty = [h for h in holders if getattr(h, "generator", None) is None]
    for index, holder in enumerate(empty):
        holder.generator = torch.Generator().manual_seed(epoch_seed(seed, index + 1))
    state = (random.getstate(), np.random.get_state())
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
            yield own
    finally:
        for holder in empty:
            holder.generator = None
        random.setstate(state[0])
        np.random.set_state(state[1])


def _forward_epoch(sampler: Any, epoch: int) -> None:
    """Call the wrapped sampler's ``set_epoch(epoch)``, if it has one."""
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _generator_holders(sampler: Any) -> list[Any]:
    """The sampler and the samplers it wraps (``.sampler``, ``.batch_sampler``) that have a ``generator``."""
    holders, seen, current = [], set(), sampler
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if hasattr(current, "generator"):
            holders.append(current)
        current = getattr(current, "sampler", None) or getattr(current, "batch_sampler", None)
    return holders


def _check_same_order(order: _Order, num_replicas: int, epoch: int, user_generators: bool) -> None:
    """Raise on every rank if the ranks' orders differ (one 2-element all_reduce; exact)."""
    if not is_distributed() or num_replicas == 1 or get_world_size() != num_replicas:
        return
    world_size = get_world_size()
    bits = max(8, (53 - world_size.bit_length()) // 2)
    value = float(order.checksum() % (1 << bits) + 1)
    probe = torch.tensor([value, value * value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        probe = probe.cuda()
    dist.all_reduce(probe)
    total, squares = (int(x) for x in probe.tolist())
    if world_size * squares == total * total:
        return
    cause = (
        "it holds a torch.Generator of its own that is not seeded the same on every rank"
        if user_generators
        else "it draws from randomness of its own (not a 'generator' attribute, nor the global RNGs)"
    )
    raise CollectiveMismatchError(
        f"the wrapped sampler produced a different order on different ranks in epoch {epoch} ({cause}), so "
        "some items would be seen twice and others never. Fix: give it generator=None (the wrapper then seeds it "
        "from seed and the epoch, the same on every rank), or seed its randomness identically on every rank"
    )
