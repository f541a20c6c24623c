"""What ``TrainLoop.fit_distributed``'s launchers take (:class:`Fits`), run on each rank (:func:`fit_worker`) and give
back (:data:`Result`)."""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch
from torch import nn

from ddpkit.callbacks import Callback
from ddpkit.checkpoint import set_rng_state
from ddpkit.process_group import get_rank
from ddpkit.training._driver import Budget
from ddpkit.training._state import RunState

__all__ = ["Fits", "Result", "fit_worker"]

#: What a launcher hands back: rank 0's (or the first replica group's) weights, ``None`` on a node without
#: rank 0, and its run state.
Result = tuple[dict[str, torch.Tensor] | None, RunState]


class Fits(Protocol):
    """What the launchers need of a ``TrainLoop``: its model, run state, fault-tolerance settings and ``fit``."""

    model: nn.Module
    state: RunState
    ddp_handler: Any
    fault_tolerance: Any

    def fit(
        self,
        num_epochs: int | None = None,
        grad_accumulation: int = 1,
        callbacks: list[Callback] | None = None,
        *,
        max_steps: int | None = None,
    ) -> dict[str, list[float]]: ...

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...


def fit_worker(
    loop: Fits,
    budget: Budget,
    grad_accumulation: int,
    callbacks: list[Callback] | None,
    every_rank: bool,
    random_state: dict[str, Any],
) -> tuple[RunState, dict[str, torch.Tensor] | None]:
    """One rank of ``fit_distributed``'s job (DDP's, or a fault-tolerant replica group's): ``loop.fit`` from the
    caller's ``random_state``; its run state, and its weights where they travel back (rank 0, or ``every_rank``
    under a scheduler that started this process)."""
    set_rng_state(random_state)  # as if fit ran in the caller: the same run every time
    if every_rank and loop.ddp_handler is not None:
        # Set up by an earlier fit in this process: start anew, as a spawned worker does with the pickled
        # loop, which comes without its sharding and DDP wrapper (TrainLoop.__getstate__).
        loop = pickle.loads(pickle.dumps(loop))
    loop.fit(budget.num_epochs, grad_accumulation, callbacks, max_steps=budget.max_steps)
    send = every_rank or get_rank() == 0  # spawned workers: only rank 0's copy travels back
    full = loop.full_state_dict()  # every rank: a sharded model's are gathered
    weights = full if send else None
    return loop.state, weights
