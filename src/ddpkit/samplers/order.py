"""The wrapped sampler's epoch, drawn the same way on every rank.

Every epoch the wrapped sampler runs once, with the global RNGs (torch, numpy,
``random``) forked and seeded with the epoch's seed and restored afterwards,
and with a generator seeded the same way in every ``generator`` attribute that
is ``None`` (the sampler's own, and those of the samplers it wraps). The
epoch's seed is ``epoch_seed`` of a base seed and the epoch. Stock
``SequentialSampler``, ``RandomSampler`` and ``BatchSampler`` are reproduced
as tensors (no Python list of N indices); any other sampler is iterated.

Randomness ddpkit cannot reach (a generator of the user's own, a private RNG)
could still differ between ranks, so such an order is compared across ranks
with one small ``all_reduce`` (:func:`check_same_order`).
"""

from __future__ import annotations

import array
import contextlib
import itertools
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from ddpkit._compat import override
from ddpkit.collectives.agreement import all_equal, signature_terms
from ddpkit.errors import CollectiveMismatchError
from ddpkit.process_group import collective_device, get_world_size, is_distributed

__all__ = ["Order", "Seeding", "check_same_order", "draw_order", "epoch_seed", "forward_epoch"]


def epoch_seed(base: int, epoch: int, *keys: int) -> int:
    """The seed of ``epoch`` for a run with base seed ``base``: a 63-bit hash of both (numpy's ``SeedSequence``).

    Different (base, epoch) pairs give unrelated seeds, so neither two epochs of
    one run nor two runs with different base seeds repeat an order by accident
    (``base + epoch`` would make epoch 1 of base 0 equal to epoch 0 of base 1).
    More ``keys`` (a position in the epoch, say) are hashed in as well.
    """
    entropy = [base % 2**64, epoch % 2**64, *(key % 2**64 for key in keys)]
    (state,) = np.random.SeedSequence(entropy).generate_state(1, np.uint64)
    return int(state) >> 1


@dataclass(frozen=True)
class Seeding:
    """Who made an epoch's order reproducible, which decides whether the ranks' orders must be compared.

    Attributes:
        by_ddpkit: every source of randomness was seeded by ddpkit (or there was
            none): the ranks agree by construction.
        user_generators: the sampler holds a ``torch.Generator`` of the user's
            own, which must be seeded alike on every rank (for the error message).
    """

    by_ddpkit: bool
    user_generators: bool = False


class Order:
    """One epoch of the wrapped sampler: its entries, from which each rank selects its own."""

    seeding: Seeding

    def __len__(self) -> int:
        raise NotImplementedError

    def checksum(self) -> int:
        """A CRC-32 of the order, identical across processes for identical orders."""
        raise NotImplementedError

    def batch_sizes(self) -> torch.Tensor | None:
        """Items in each entry (int64) for a batch sampler, ``None`` for an item sampler."""
        raise NotImplementedError

    def select(self, indices: torch.Tensor) -> list[Any]:
        """The entries at ``indices``, in that order."""
        raise NotImplementedError


class DrawnOrder(Order):
    """The entries as a sampler yielded them (indices, or lists of indices)."""

    def __init__(self, drawn: list[Any], seeding: Seeding) -> None:
        self.drawn = drawn
        self.seeding = seeding
        self.batched = bool(drawn) and isinstance(drawn[0], (list, tuple))

    @override
    def __len__(self) -> int:
        return len(self.drawn)

    @override
    def batch_sizes(self) -> torch.Tensor | None:
        if not self.batched:
            return None
        return torch.tensor([len(batch) for batch in self.drawn], dtype=torch.int64)

    @override
    def select(self, indices: torch.Tensor) -> list[Any]:
        drawn = self.drawn
        return [drawn[i] for i in indices.tolist()]

    @override
    def checksum(self) -> int:
        flat = itertools.chain.from_iterable(self.drawn) if self.batched else self.drawn
        try:
            data = array.array("q", flat).tobytes()
        except (TypeError, OverflowError):  # not integers: compare their text
            data = repr(self.drawn).encode()
        sizes = self.batch_sizes()
        crc = zlib.crc32(data)
        return zlib.crc32(sizes.numpy().tobytes(), crc) if sizes is not None else crc


class IndexOrder(Order):
    """Indices as a tensor, and optionally batches as (start, size) runs of it: no Python list of N items."""

    def __init__(
        self, indices: torch.Tensor, seeding: Seeding, batch_size: int | None = None, drop_last: bool = False
    ) -> None:
        self.indices = indices
        self.seeding = seeding
        self.batch_size = batch_size
        if batch_size is None:
            self.count = len(indices)
        else:
            self.count = len(indices) // batch_size if drop_last else -(-len(indices) // batch_size)

    @override
    def __len__(self) -> int:
        return self.count

    @override
    def batch_sizes(self) -> torch.Tensor | None:
        if self.batch_size is None:
            return None
        sizes = torch.full((self.count,), self.batch_size, dtype=torch.int64)
        if self.count and self.count * self.batch_size > len(self.indices):
            sizes[-1] = len(self.indices) - (self.count - 1) * self.batch_size
        return sizes

    @override
    def checksum(self) -> int:
        return zlib.crc32(self.indices.numpy().tobytes(), self.batch_size or 0)

    @override
    def select(self, indices: torch.Tensor) -> list[Any]:
        if self.batch_size is None:
            return list(self.indices[indices].tolist())
        b, flat = self.batch_size, self.indices
        return [flat[e * b : (e + 1) * b].tolist() for e in indices.tolist()]


def draw_order(sampler: Any, seed: Callable[[], int]) -> Order:
    """One epoch of ``sampler``, with its randomness seeded from ``seed()`` (called only if something is random)."""
    fast = _stock_order(sampler, seed)
    if fast is not None:
        return fast
    with _seeded(sampler, seed()) as user_generators:
        drawn = list(iter(sampler))
    return DrawnOrder(drawn, Seeding(by_ddpkit=False, user_generators=user_generators))


def forward_epoch(sampler: Any, epoch: int) -> None:
    """Call the wrapped sampler's ``set_epoch(epoch)``, if it has one."""
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def check_same_order(order: Order, num_replicas: int, epoch: int) -> None:
    """Raise on every rank if the ranks' orders differ (one 2-element ``all_reduce``; exact).

    Does nothing without a process group of ``num_replicas`` ranks.

    Raises:
        CollectiveMismatchError: the orders differ; the message says why and how to fix it.
    """
    if not is_distributed() or num_replicas == 1 or get_world_size() != num_replicas:
        return
    probe = torch.tensor(signature_terms(order.checksum(), num_replicas), dtype=torch.float64)
    probe = probe.to(collective_device())
    dist.all_reduce(probe)
    total, squares = probe.tolist()
    if all_equal(total, squares, num_replicas):
        return
    cause = (
        "it holds a torch.Generator of its own that is not seeded the same on every rank"
        if order.seeding.user_generators
        else "it draws from randomness of its own (not a 'generator' attribute, nor the global RNGs)"
    )
    raise CollectiveMismatchError(
        f"the wrapped sampler produced a different order on different ranks in epoch {epoch} ({cause}), so "
        "some items would be seen twice and others never. Fix: give it generator=None (the wrapper then seeds it "
        "from seed and the epoch, the same on every rank), or seed its randomness identically on every rank"
    )


def _stock_order(sampler: Any, seed: Callable[[], int]) -> IndexOrder | None:
    """The exact order of a stock ``SequentialSampler``, ``RandomSampler`` (no replacement) or a
    ``BatchSampler`` of one, computed as a tensor; ``None`` for any other sampler.

    A ``RandomSampler`` without a generator draws from a generator seeded with ``seed()``.
    """
    kind = type(sampler)
    if kind is BatchSampler:
        inner = _stock_order(sampler.sampler, seed)
        if inner is None or inner.batch_size is not None:
            return None
        return IndexOrder(inner.indices, inner.seeding, sampler.batch_size, sampler.drop_last)
    if kind is SequentialSampler:
        return IndexOrder(torch.arange(len(sampler.data_source), dtype=torch.int64), Seeding(by_ddpkit=True))
    if kind is RandomSampler and not sampler.replacement:
        n, count = len(sampler.data_source), sampler.num_samples
        ours = sampler.generator is None
        generator = torch.Generator().manual_seed(seed()) if ours else sampler.generator
        # As RandomSampler.__iter__ draws: one permutation per full pass, then one for the rest.
        parts = [torch.randperm(n, generator=generator) for _ in range(count // n)]
        parts.append(torch.randperm(n, generator=generator)[: count % n])
        indices = torch.cat(parts) if len(parts) > 1 else parts[0]
        return IndexOrder(indices, Seeding(by_ddpkit=ours, user_generators=not ours))
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


def _generator_holders(sampler: Any) -> list[Any]:
    """The sampler and the samplers it wraps (``.sampler``, ``.batch_sampler``) that have a ``generator``."""
    holders, seen, current = [], set(), sampler
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if hasattr(current, "generator"):
            holders.append(current)
        current = getattr(current, "sampler", None) or getattr(current, "batch_sampler", None)
    return holders
