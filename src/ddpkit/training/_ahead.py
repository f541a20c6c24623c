"""A fault-tolerant run's training data: each step's share through the training loader, loaded ahead.

A step's items are known before its quorum: entries ``[low, low + G)`` of the epoch's global order. Only
their split over the quorum's participants waits for it, and that rarely changes. So the shares of the rest of
the epoch, as the last quorum dealt them, are the batches of the training loader rebuilt with a batch sampler
of them (:func:`~ddpkit.extract_loader_parameters`: its workers, ``collate_fn``, ``pin_memory``, prefetching,
``worker_init_fn``, start method), whose workers load them while the group trains. When the quorum deals
otherwise (a group left or joined), or a step is done again, the plan starts over at that step with the new
deal, through the same loader. Its workers persist for the whole run, whatever the loader's
``persistent_workers``: a new deal or epoch restarts their queue in milliseconds, where new workers take a
fork (or a spawn) each time, on the way to the next commit; ``worker_init_fn`` runs once per worker. Without
workers the loader loads each batch in the process when it is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from ddpkit.loaders import extract_loader_parameters
from ddpkit.training._deal import share_sizes, shares

__all__ = ["ShareLoader"]


class _Planned:
    """The internal loader's batch sampler: the batches planned when its iterator was made."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ShareLoader:
    """The shares of the rest of an epoch, as one deal gives them, through the training ``loader`` rebuilt.

    Args:
        loader: the training loader; every setting but its data's is kept.
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
        settings = {**extract_loader_parameters(loader, True), "generator": self._generator}
        settings["persistent_workers"] = loader.num_workers > 0
        self._loader = DataLoader(loader.dataset, batch_sampler=self._plan, **settings)
        self.workers = loader.num_workers > 0
        self.batch_size, self.size, self._order, self._seed = batch_size, global_batch_size, order, seed
        self._iterator: Iterator[Any] | None = None
        self._next: tuple[int, int, int, int] | None = None  # (epoch, low, participants, index) it holds next
        #: Steps whose share came as planned, and steps whose plan started over.
        self.ahead = self.here = 0

    def start_workers(self) -> None:
        """Start the workers now, with nothing planned yet: before this process starts other threads (torchft's
        manager, the process group's), which a forked worker would inherit in whatever state they are."""
        if self.workers:
            self._generator.manual_seed(self._seed(0, 0))
            iter(self._loader)  # persistent workers: later iterators reuse them

    def share(self, epoch: int, low: int, participants: int, index: int) -> Iterator[Any]:
        """The batches of participant ``index``'s share of the step at position ``low`` of ``epoch`` among
        ``participants``; the workers go on from the next step with this deal."""
        if self._iterator is None or self._next != (epoch, low, participants, index):
            self._start(epoch, low, participants, index)
            self.here += 1
        else:
            self.ahead += 1
        assert self._iterator is not None
        step_items = min(self.size, int(self._order(epoch).shape[0]) - low)
        self._next = (epoch, low + self.size, participants, index)
        iterator = self._iterator
        return (next(iterator) for _ in share_sizes(step_items, participants, index, self.batch_size))

    def _start(self, epoch: int, low: int, participants: int, index: int) -> None:
        """Plan the shares from position ``low`` to the end of ``epoch`` with this deal, and start loading."""
        order = self._order(epoch)
        self._plan.batches = [
            batch.tolist()
            for start in range(low, len(order), self.size)
            for batch in shares(order[start : start + self.size], participants, index, self.batch_size)
        ]
        self._generator.manual_seed(self._seed(epoch, low))  # the workers' seeds, drawn when they start
        self._iterator = iter(self._loader)

    def close(self) -> None:
        """Stop the workers (the loader's iterator, which holds them, is dropped)."""
        self._iterator = self._next = None
        self._loader = None  # type: ignore[assignment]
