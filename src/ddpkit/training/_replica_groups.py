"""``TrainLoop.fit_distributed`` with fault tolerance: each of its processes a replica group under an agent of
its own (as ``ddpkit run --fault-tolerance``'s groups), through the launcher DDP's ``fit_distributed`` uses.

Each group is a process of multiprocessing's spawn start method, so that a Dataset, model or collate function
defined in the user's script is found (the script is imported again as ``__mp_main__``, its ``if __name__ ==
"__main__"`` block not run), as in a spawned DDP worker. It runs :func:`~ddpkit.launch` of ``fit`` on the
group's ranks (``_new_processes._fit_worker``, DDP's), its agent starting them again when one dies, and sends
back rank 0's result as DDP's workers return it (its run state and weights) through a queue: the caller takes
the first group's that finished. A group started again after the job's end trains nothing and sends no weights.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import pickle
import queue
from dataclasses import replace
from typing import Any

import torch

from ddpkit.callbacks import Callback
from ddpkit.checkpoint import rng_state
from ddpkit.environments.replica_group import REPLICA_ID_VARIABLE
from ddpkit.errors import WorkerFailedError
from ddpkit.fault_tolerance import TorchFT
from ddpkit.fault_tolerance._job import Child, StartGroup, job_shape_problems, run_node_group, run_replica_groups
from ddpkit.jobs.launch import launch, scheduler_environment
from ddpkit.training._driver import Budget
from ddpkit.training._launched import Fits, Result, fit_worker
from ddpkit.training._state import RunState

__all__ = ["fit_replica_groups"]

_SPAWN = multiprocessing.get_context("spawn")

#: What a group sends back: its id, its rank 0's run state, and its weights (``None``: it trained nothing).
_Sent = tuple[str, RunState, dict[str, torch.Tensor] | None]


def fit_replica_groups(
    loop: Fits, settings: TorchFT, budget: Budget, num_processes: int, callbacks: list[Callback] | None,
    max_restarts: int, **launch_arguments: Any,
) -> Result:  # fmt: skip
    """Train ``loop`` as ``num_processes`` replica groups of one process on this machine, each started again
    up to ``max_restarts`` times when it dies; the weights and run state of the first group that finished.
    With ``nnodes`` N above 1 (and ``rdzv_endpoint``, the lighthouse's ``HOST:PORT``), this node's replica group
    instead, of ``num_processes`` ranks, one of N (``ddpkit run --fault-tolerance --nnodes N``): its weights and
    run state. ``launch_arguments``: the rest of ``fit_distributed``'s, honoured or refused.

    Raises:
        ValueError: an argument that cannot be honoured (:func:`_honoured`).
        WorkerFailedError: a group failed (after its restarts); no group finished.
    """
    settings = _honoured(settings, **launch_arguments)
    groups_loop = copy.copy(loop)  # as pickled: without its set-up (TrainLoop.__getstate__)
    # Each group takes the lighthouse and its own id from the variables its process is given.
    groups_loop.fault_tolerance = replace(settings, lighthouse=None, replica_id=None)
    results = _Results()
    start = _function_groups(results, groups_loop, budget, callbacks, max_restarts)
    nodes, endpoint = int(launch_arguments["nnodes"]), launch_arguments["rdzv_endpoint"]
    if nodes > 1:  # this node's group
        statuses = [run_node_group(start, nnodes=nodes, endpoint=endpoint, nprocs=num_processes,
                                   replica_id=settings.replica_id, min_replicas=settings.min_replicas)]  # fmt: skip
    else:
        statuses = run_replica_groups(start, groups=num_processes, lighthouse=settings.lighthouse,
                                      min_replicas=settings.min_replicas)  # fmt: skip
    results.drain(0.0)
    finished = [(state, weights) for _, state, weights in results.received if weights is not None]
    failed = [(group, status) for group, status in enumerate(statuses) if status != 0]
    if not failed and not finished:  # every group ended well, none with a result: it came back too late
        raise WorkerFailedError(
            0, 0, "this node's replica group ended without a result: started again after the job's other "
            "groups had finished, it trained nothing (their callers, on the other nodes, have the result)",
        )  # fmt: skip
    if failed or not finished:
        group, status = failed[0] if failed else (0, statuses[0])
        name = f"group-{group}" if nodes == 1 else "of this node"
        raise WorkerFailedError(
            group, status, f"replica group {name} exited with status {status} after its restarts "
            f"({len(finished)} of {len(statuses)} groups finished; their output is above)",
            failures={g: f"exit status {s}" for g, s in failed},
        )  # fmt: skip
    state, weights = finished[0]
    return weights, state


def _honoured(
    settings: TorchFT, *, grad_accumulation: int, backend: str | None, timeout: float | None, nnodes: int | str,
    rdzv_endpoint: str | None, rdzv_conf: object, start_method: str,
) -> TorchFT:  # fmt: skip
    """``settings`` with ``timeout`` in them; a ``ValueError`` naming every other argument that the replica
    groups cannot honour, and why."""
    refused = job_shape_problems(nnodes, rdzv_endpoint, 1, flags=False)
    for name, value, default, why in (
        ("grad_accumulation", grad_accumulation, 1, "a step commits once per global batch"),
        ("rdzv_conf", rdzv_conf, None, "the groups meet at the lighthouse, not at a rendezvous"),
        ("backend", backend, None, "the groups all-reduce through torchft's gloo process group"),
        ("start_method", start_method, "spawn", "each group is a new interpreter, as with 'spawn'"),
    ):
        if value != default and not (name == "backend" and value == "gloo"):
            refused.append(f"{name}={value!r} ({why})")
    if timeout == 0:
        refused.append("timeout=0 (a fault-tolerant step needs a deadline to drop a group that hangs)")
    if scheduler_environment() is not None:
        refused.append("a scheduler started this process (call it once a node, as a plain command)")
    if refused:
        raise ValueError(
            f"fit_distributed with fault_tolerance runs replica groups on this machine (or, with nnodes=N and "
            f"rdzv_endpoint, this node's group); it cannot honour {'; '.join(refused)}"
        )
    return settings if timeout is None else replace(settings, timeout=timeout)


class _Results:
    """What the groups send back, in the order they finished (:attr:`received`), read while they run: a group
    ends only once what it sent has been read (a queue's pipe holds 64 KiB)."""

    def __init__(self) -> None:
        self.queue: Any = _SPAWN.Queue()
        self.received: list[_Sent] = []

    def drain(self, timeout: float) -> None:
        """Take what was sent, waiting up to ``timeout`` seconds for the first of it."""
        try:
            self.received.append(pickle.loads(self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()))
            while True:
                self.received.append(pickle.loads(self.queue.get_nowait()))
        except queue.Empty:
            return


class _GroupProcess:
    """A replica group's process (:class:`~ddpkit.fault_tolerance._job.Child`), reading what the groups send
    while it waits."""

    def __init__(self, process: Any, results: _Results) -> None:
        self.process, self.results, self.pid = process, results, process.pid

    def wait(self) -> int:
        while self.process.is_alive():
            self.results.drain(0.2)
        self.process.join()
        return int(self.process.exitcode)

    def poll(self) -> int | None:
        return None if self.process.is_alive() else int(self.process.exitcode)

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


def _function_groups(
    results: _Results, loop: Fits, budget: Budget, callbacks: list[Callback] | None, max_restarts: int
) -> StartGroup:
    """Start each group as a spawned process that launches ``loop.fit`` on its ranks (every group from this
    process's random state, as DDP's workers)."""
    random_state = rng_state()

    def start(replica_id: str, size: int | None, variables: dict[str, str]) -> Child:
        process = _SPAWN.Process(
            target=_run_group, name=f"replica group {replica_id}",
            args=(variables, size or 1, max_restarts, loop, budget, callbacks, random_state, results.queue),
        )  # fmt: skip
        process.start()
        return _GroupProcess(process, results)

    return start


def _run_group(
    variables: dict[str, str], size: int, max_restarts: int, loop: Fits, budget: Budget,
    callbacks: list[Callback] | None, random_state: dict[str, Any], sent: Any,
) -> None:  # fmt: skip
    """One replica group's process: its agent runs ``fit`` on its ranks (started again when one dies); then its
    rank 0's result goes to ``sent``."""
    os.environ.update(variables)  # the lighthouse, the group's id, the job secret: its ranks inherit them
    returned = launch(_fit_group, loop, budget, callbacks, random_state, nprocs=size, max_restarts=max_restarts,
                      start_method="spawn")  # fmt: skip
    state, weights = returned[min(returned)]
    # Pickled here, the tensors' bytes with them: through the queue itself they would go as shared memory, which
    # this process takes away when it ends.
    sent.put(pickle.dumps((variables[REPLICA_ID_VARIABLE], state, weights)))
    sent.close()
    sent.join_thread()


def _fit_group(
    loop: Fits, budget: Budget, callbacks: list[Callback] | None, random_state: dict[str, Any]
) -> tuple[RunState, dict[str, torch.Tensor] | None]:
    """A rank of a replica group: DDP's worker; a group that finds the job finished trains nothing (its
    driver's ``SystemExit(0)``) and returns no weights."""
    try:
        return fit_worker(loop, budget, 1, callbacks, False, random_state)
    except SystemExit as ended:
        if ended.code not in (0, None):
            raise
        return loop.state, None
