"""``TrainLoop.fit_distributed``'s work: the loop pickled to new processes (or a scheduler's), each running ``fit``."""

from __future__ import annotations

import pickle
from collections import defaultdict
from typing import Any

import torch

from ddpkit.callbacks import Callback
from ddpkit.checkpoint import rng_state, set_rng_state
from ddpkit.jobs.launch import launch, scheduler_environment, start_forkserver
from ddpkit.process_group import get_rank
from ddpkit.training._launched import Fits, Result
from ddpkit.training._state import RunState

__all__ = ["fit_elsewhere", "fit_on_new_processes"]


def fit_elsewhere(
    loop: Fits, num_epochs: int, num_processes: int, grad_accumulation: int, callbacks: list[Callback] | None,
    *, max_restarts: int, **launch_options: Any,
) -> Result:  # fmt: skip
    """``fit_distributed``'s run: on new processes (:func:`fit_on_new_processes`), or with fault tolerance as
    replica groups (``_replica_groups.fit_replica_groups``); rank 0's (the first group's) weights and run state."""
    settings = loop.fault_tolerance
    if settings is None:
        weights, state = fit_on_new_processes(
            loop, num_epochs, num_processes, grad_accumulation, callbacks, max_restarts=max_restarts, **launch_options
        )
    else:
        # Imported here: each group runs that module as its main (`python -m`), which warns if it was imported.
        from ddpkit.training._replica_groups import fit_replica_groups

        weights, state = fit_replica_groups(
            loop, settings, num_epochs, num_processes, callbacks, max_restarts, grad_accumulation=grad_accumulation,
            **launch_options,
        )  # fmt: skip
    state.history = defaultdict(list, state.history)
    return weights, state


def fit_on_new_processes(
    loop: Fits,
    num_epochs: int,
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
        start_forkserver("torch._dynamo")  # DDP's constructor imports it: 2 s per worker otherwise
    results = launch(
        _fit_worker, loop, num_epochs, grad_accumulation, callbacks, in_this_process, rng_state(),
        nprocs=None if in_this_process else num_processes, **launch_options,
    )  # fmt: skip
    state: RunState
    state, weights = results[min(results)]
    return weights, state


def _fit_worker(
    loop: Fits,
    num_epochs: int,
    grad_accumulation: int,
    callbacks: list[Callback] | None,
    every_rank: bool,
    random_state: dict[str, Any],
) -> tuple[RunState, dict[str, torch.Tensor] | None]:
    set_rng_state(random_state)  # as if fit ran in the caller: the same run every time
    if every_rank and loop.ddp_handler is not None:
        # Set up by an earlier fit in this process: start anew, as a spawned worker does with the pickled
        # loop, which comes without its sharding and DDP wrapper (TrainLoop.__getstate__).
        loop = pickle.loads(pickle.dumps(loop))
    loop.fit(num_epochs, grad_accumulation, callbacks)
    send = every_rank or get_rank() == 0  # spawned workers: only rank 0's copy travels back
    weights = {k: v.detach().cpu() for k, v in loop.model.state_dict().items()} if send else None
    return loop.state, weights
