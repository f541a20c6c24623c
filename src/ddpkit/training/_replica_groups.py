"""``TrainLoop.fit_distributed`` with fault tolerance: each of its processes a replica group under an agent of
its own (as ``ddpkit run --fault-tolerance``), the loop pickled to them through a private directory.

The parent writes ``(loop, num_epochs, callbacks, random state)`` to ``loop.pickle`` in a directory only its
user can read (``mkdtemp``), starts the groups with ``python -m ddpkit.training._replica_groups DIRECTORY``
as their script, and reads back what each group wrote when it finished: its weights and run state, as plain
tensors and values (loaded with ``weights_only=True``).

Before the loop, the file holds what :mod:`multiprocessing`'s spawn start method hands a child to prepare it
(``multiprocessing.spawn.get_preparation_data``: the parent's ``sys.path``, working directory and main
module), and each group prepares itself with it (``multiprocessing.spawn.prepare``) before it unpickles the
loop, exactly as a spawned DDP worker does: a Dataset, model or collate function defined in the user's
script is found (the script is imported again as ``__mp_main__``, its ``if __name__ == "__main__"`` block
not run).
"""

from __future__ import annotations

import copy
import multiprocessing.spawn
import os
import pickle
import shutil
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from ddpkit.callbacks import Callback
from ddpkit.checkpoint import rng_state, set_rng_state
from ddpkit.environments.replica_group import REPLICA_ID_VARIABLE
from ddpkit.errors import WorkerFailedError
from ddpkit.fault_tolerance import TorchFT
from ddpkit.fault_tolerance._job import run_node_group, run_replica_groups
from ddpkit.jobs.launch import scheduler_environment
from ddpkit.training._launched import Fits, Result
from ddpkit.training._state import RunState

__all__ = ["fit_replica_groups"]

_LOOP_FILE = "loop.pickle"


def fit_replica_groups(
    loop: Fits, settings: TorchFT, num_epochs: int, num_processes: int, callbacks: list[Callback] | None,
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
    directory = Path(tempfile.mkdtemp(prefix="ddpkit-replica-groups-"))
    try:
        groups_loop = copy.copy(loop)  # as pickled: without its set-up (TrainLoop.__getstate__)
        # Each group takes the lighthouse and its own id from the variables its agent sets.
        groups_loop.fault_tolerance = replace(settings, lighthouse=None, replica_id=None)
        with open(directory / _LOOP_FILE, "wb") as handle:
            pickle.dump(_preparation(), handle)
            pickle.dump((groups_loop, num_epochs, callbacks, rng_state()), handle)
        nodes, endpoint = int(launch_arguments["nnodes"]), launch_arguments["rdzv_endpoint"]
        if nodes > 1:  # this node's group
            statuses = [run_node_group(
                "ddpkit.training._replica_groups", [str(directory)], nnodes=nodes, endpoint=endpoint,
                nprocs=num_processes, replica_id=settings.replica_id, max_restarts=max_restarts, module=True,
                min_replicas=settings.min_replicas,
            )]  # fmt: skip
        else:
            statuses = run_replica_groups(
                "ddpkit.training._replica_groups", [str(directory)], groups=num_processes, max_restarts=max_restarts,
                module=True, lighthouse=settings.lighthouse, min_replicas=settings.min_replicas,
            )  # fmt: skip
        finished = sorted(directory.glob("result-*.pt"), key=lambda path: path.stat().st_mtime_ns)  # first first
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
        result = torch.load(finished[0], weights_only=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return result["weights"], RunState(**result["state"])


def _honoured(
    settings: TorchFT, *, grad_accumulation: int, backend: str | None, timeout: float | None, nnodes: int | str,
    rdzv_endpoint: str | None, rdzv_conf: object, start_method: str,
) -> TorchFT:  # fmt: skip
    """``settings`` with ``timeout`` in them; a ``ValueError`` naming every other argument that the replica
    groups cannot honour, and why."""
    refused = []
    several = isinstance(nnodes, int) and not isinstance(nnodes, bool) and nnodes > 1
    if not several and nnodes != 1:
        refused.append(f"nnodes={nnodes!r} (one replica group a node: a whole number of nodes)")
    if several and rdzv_endpoint is None:
        refused.append(f"nnodes={nnodes} without rdzv_endpoint (the lighthouse's 'HOST:PORT', the same on every node)")
    for name, value, default, why in (
        ("grad_accumulation", grad_accumulation, 1, "a step commits once per global batch"),
        ("rdzv_endpoint", None if several else rdzv_endpoint, None, "the lighthouse of a job on several nodes"),
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


def _preparation() -> dict[str, Any]:
    """What a spawned child needs to unpickle what the parent's main module defines (its authkey left out)."""
    data: dict[str, Any] = multiprocessing.spawn.get_preparation_data("replica-group")
    data.pop("authkey", None)
    return data


def _run_group(directory: Path) -> None:
    """One replica group's process: ``fit`` the pickled loop, then write this group's result."""
    with open(directory / _LOOP_FILE, "rb") as handle:  # written by this user's parent
        multiprocessing.spawn.prepare(pickle.load(handle))  # the parent's sys.path, directory, main module
        loop, num_epochs, callbacks, random_state = pickle.load(handle)
    set_rng_state(random_state)
    loop.fit(num_epochs, callbacks=callbacks)
    state = {field.name: getattr(loop.state, field.name) for field in fields(RunState) if field.init}
    state["history"] = {name: list(values) for name, values in state["history"].items()}
    if int(os.environ.get("RANK", "0")) != 0:  # a group of several ranks: its rank 0 writes
        return
    weights = {name: value.detach().cpu() for name, value in loop.model.state_dict().items()}
    target = directory / f"result-{os.environ[REPLICA_ID_VARIABLE]}.pt"
    torch.save({"weights": weights, "state": state}, f"{target}.partial")
    os.replace(f"{target}.partial", target)


if __name__ == "__main__":
    _run_group(Path(sys.argv[1]))
