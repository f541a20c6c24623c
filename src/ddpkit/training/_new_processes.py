"""``TrainLoop.fit_distributed``'s work: the loop pickled to new processes (or a scheduler's), each running ``fit``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from ddpkit._torch_private import NAMES
from ddpkit.callbacks import Callback
from ddpkit.checkpoint import rng_state
from ddpkit.jobs.launch import launch, scheduler_environment, start_forkserver
from ddpkit.training._driver import Budget
from ddpkit.training._launched import Fits, Result, fit_worker
from ddpkit.training._replica_groups import fit_replica_groups
from ddpkit.training._state import RunState

__all__ = ["fit_elsewhere", "fit_on_new_processes"]


def fit_elsewhere(
    loop: Fits, budget: Budget, num_processes: int, grad_accumulation: int, callbacks: list[Callback] | None,
    *, max_restarts: int, **launch_options: Any,
) -> Result:  # fmt: skip
    """``fit_distributed``'s run: on new processes (:func:`fit_on_new_processes`), or with fault tolerance as
    replica groups (``_replica_groups.fit_replica_groups``); rank 0's (the first group's) weights and run state."""
    settings = loop.fault_tolerance
    if settings is None:
        weights, state = fit_on_new_processes(
            loop, budget, num_processes, grad_accumulation, callbacks, max_restarts=max_restarts, **launch_options
        )
    else:
        weights, state = fit_replica_groups(
            loop, settings, budget, num_processes, callbacks, max_restarts, grad_accumulation=grad_accumulation,
            **launch_options,
        )  # fmt: skip
    state.history = defaultdict(list, state.history)
    return weights, state


def fit_on_new_processes(
    loop: Fits,
    budget: Budget,
    num_processes: int,
    grad_accumulation: int,
    callbacks: list[Callback] | None,
    **launch_options: Any,
) -> Result:
    """Run ``loop.fit`` (a ``TrainLoop``'s) on ``num_processes`` new processes through :func:`~ddpkit.launch`;
    rank 0's weights and run state (history, steps, last step's metrics).

    Every worker starts from this process's random state. Under a scheduler that started the job's processes,
    this process trains as one of its ranks instead. ``launch_options`` are :func:`~ddpkit.launch`'s.
    """
    in_this_process = scheduler_environment() is not None  # srun, mpirun, torchrun: no spawning
    if not in_this_process and launch_options.get("start_method") == "forkserver":
        start_forkserver(NAMES["dynamo"].module)  # DDP's constructor imports it: 2 s per worker otherwise
    results = launch(
        fit_worker, loop, budget, grad_accumulation, callbacks, in_this_process, rng_state(),
        nprocs=None if in_this_process else num_processes, **launch_options,
    )  # fmt: skip
    state: RunState
    state, weights = results[min(results)]
    return weights, state
