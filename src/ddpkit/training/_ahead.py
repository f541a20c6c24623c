"""A fault-tolerant run's items loaded ahead by the training loader's own workers.

A step's items are known before its quorum: entries ``[low, low + G)`` of the epoch's global order. Only
their split over the quorum's participants waits for it, and that rarely changes. So the next steps' shares,
as the last quorum would deal them, go to a DataLoader built like the training loader (its workers,
``collate_fn``, ``pin_memory``, prefetching, ``worker_init_fn``, start method), which loads them while the
group trains. When the quorum deals otherwise (a group left or joined), or a step is done again, that step is
loaded in the process, as without workers, and the workers start over from the next step with the new deal.
The workers persist for the whole run, whatever the loader's ``persistent_workers``: a new deal or epoch
restarts their queue in milliseconds, where new workers take a fork (or a spawn) each time, on the way to
the next commit; ``worker_init_fn`` runs once per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["AheadLoader", "shares"]


def shares(step: torch.Tensor, participants: int, index: int, batch_size: int) -> tuple[torch.Tensor, ...]:
    """Participant ``index``'s batches of ``step`` (dataset indices) among ``participants``: the entries
    ``index``, ``index + participants``, ... in batches of ``batch_size`` (the distributed sampler's deal)."""
    return torch.split(step[index::participants], batch_size)


class _Planned:
    """The internal loader's batch sampler: the batches planned when its iterator was made."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class AheadLoader:
    """The shares of the rest of an epoch, as one deal gives them, loaded ahead by ``loader``'s workers.

    Args:
        loader: the training loader (with ``num_workers > 0``); its settings are copied.
        batch_size: items per batch of a share.
        global_batch_size: items per step (the epoch's last step has what is left).
        order: an epoch's global order (dataset indices) by its number.
        seed: where each plan's worker seeds come from (with the epoch and the position).
    """

    def __init__(
        self, loader: DataLoader[Any], batch_size: int, global_batch_size: int,
        order: Callable[[int], torch.Tensor], seed: Callable[[int, int], int],
    ) -> None:  # fmt: skip
        self._plan = _Planned()
        self._generator = torch.Generator()
        self._loader: DataLoader[Any] | None = DataLoader(
            loader.dataset, batch_sampler=self._plan, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, generator=self._generator,
            prefetch_factor=loader.prefetch_factor, persistent_workers=True,
            pin_memory_device=loader.pin_memory_device,
        )  # fmt: skip
        self.batch_size, self.size, self._order, self._seed = batch_size, global_batch_size, order, seed
        self._iterator: Iterator[Any] | None = None
        self._next: tuple[int, int, int, int] | None = None  # (epoch, low, participants, index) it holds next
        #: Steps whose share came from the workers, and steps loaded in the process.
        self.ahead = self.here = 0

    def start_workers(self) -> None:
        """Start the workers now, with nothing planned yet: before this process starts other threads (torchft's
        manager, the process group's), which a forked worker would inherit in whatever state they are."""
        if self._loader is not None:
            self._generator.manual_seed(self._seed(0, 0))
            iter(self._loader)  # persistent workers: later iterators reuse them

    def share(self, epoch: int, low: int, participants: int, index: int) -> list[Any] | None:
        """The batches of participant ``index``'s share of the step at position ``low`` of ``epoch`` among
        ``participants``, loaded ahead; ``None`` when they were planned otherwise (load them in the process).
        Either way the workers go on from the next step with this deal."""
        if self._iterator is not None and self._next == (epoch, low, participants, index):
            step = self._order(epoch)[low : low + self.size]
            batches = [next(self._iterator) for _ in shares(step, participants, index, self.batch_size)]
            self._next = (epoch, low + self.size, participants, index)
            self.ahead += 1
            return batches
        self._start(epoch, low + self.size, participants, index)
        self.here += 1
        return None

    def _start(self, epoch: int, low: int, participants: int, index: int) -> None:
        """Plan the shares from position ``low`` to the end of ``epoch`` with this deal, and start loading."""
        order = self._order(epoch)
        self._plan.batches = [
            batch.tolist()
            for start in range(low, len(order), self.size)
            for batch in shares(order[start : start + self.size], participants, index, self.batch_size)
        ]
        self._iterator, self._next = None, None
        if self._plan.batches and self._loader is not None:
            self._generator.manual_seed(self._seed(epoch, low))  # the workers' seeds, drawn when they start
            self._iterator, self._next = iter(self._loader), (epoch, low, participants, index)

    def close(self) -> None:
        """Stop the workers (the loader, which holds them, is dropped); every later share is loaded here."""
        self._iterator = self._next = self._loader = None
