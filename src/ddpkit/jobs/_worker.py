"""A rank's side of a job: share the node's cores, group up, run, group down.

Used by every worker that :func:`~ddpkit.launch` spawns (:func:`worker_entry`)
and by every process a scheduler started itself (``srun``, ``mpirun``, ...:
:func:`run_in_this_task`), so both run the user's function the same way.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ddpkit._failures import write_record
from ddpkit._orphans import children_die_with_this_process, die_with_parent
from ddpkit.environments import (
    ClusterEnvironment,
    TorchElasticEnvironment,
    detect_environment,
    is_one_of_several_ranks,
)
from ddpkit.process_group import barrier, destroy_dist_connection, init_dist_connection

__all__ = [
    "WorkerSpec",
    "limit_threads",
    "pickled",
    "run_in_this_task",
    "scheduler_environment",
    "torchrun_variables",
    "warn_ignored_nprocs",
    "worker_entry",
]


@dataclass(frozen=True)
class WorkerSpec:
    """What each worker process needs besides the positional arguments (pickled once per worker)."""

    fn: Callable[..., Any]
    failure_dir: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    timeout: float | None = None
    #: How the worker was started ("spawn", "forkserver" or "fork").
    start_method: str = "spawn"
    #: The launching process's environment at the launch (a forkserver's children start from the server's).
    environ: dict[str, str] | None = None


#: The process that imported this module, and its environment then: in a forkserver that preloaded ddpkit,
#: what its children inherit (the environment torch's launcher changed is the rank's own).
_IMPORTED_IN = os.getpid()
_FORKSERVER_ENVIRON = dict(os.environ)


def scheduler_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """The cluster environment, when a scheduler already started this job's processes; else ``None``.

    That is: :func:`~ddpkit.detect_environment` reports processes created
    externally (``srun``, ``mpirun``, torchrun, a Kubeflow or LSF job, or
    ``RANK`` set by hand) and a world size above 1, or any world size under
    torchrun (an elastic job may shrink to one rank, which must not start a
    launcher of its own). :func:`~ddpkit.launch` and :func:`~ddpkit.run_script`
    then run in this process instead of spawning.
    """
    found = detect_environment(env)
    started = is_one_of_several_ranks(found) or (found.creates_processes_externally and found.name == "torchelastic")
    return found if started else None


def run_as_rank(env: ClusterEnvironment, spec: WorkerSpec, args: tuple[Any, ...]) -> Any:
    """Share the cores, group up, run ``fn`` once, wait for every rank, group down (on every path).

    A failure is recorded in ``spec.failure_dir`` (when set) before the group goes
    down: the peers fail after that, so the earliest record is the root cause.
    """
    limit_threads(env.local_world_size())
    try:
        init_dist_connection(env, spec.backend, hang_timeout=spec.timeout)
        result = spec.fn(*args, **spec.kwargs)
        barrier()  # rank 0 hosts the store: keep it up until every rank is done
        return result
    except BaseException as exc:
        if spec.failure_dir:
            write_record(spec.failure_dir, exc)
        raise
    finally:
        destroy_dist_connection()


def run_in_this_task(
    env: ClusterEnvironment, spec: WorkerSpec, args: tuple[Any, ...], nprocs: int | None
) -> dict[int, Any]:
    """``launch`` as one of a scheduler's tasks: ``fn`` runs here, on its own copy of the arguments."""
    warn_ignored_nprocs(env, nprocs)
    spec, args = pickle.loads(pickled(spec, args))  # its own copy, as a spawned worker has
    return {int(env.global_rank()): run_as_rank(env, spec, args)}


def worker_entry(payload: str | tuple[WorkerSpec, tuple[Any, ...]]) -> Any:
    """Entry point of every spawned worker: its arguments (a pickle file's path, or the objects under
    ``fork``), dying with its parent, and a failure record if ``fn`` raises."""
    spec: WorkerSpec
    if isinstance(payload, str):
        with open(payload, "rb") as handle:
            spec, args = pickle.load(handle)
    else:
        spec, args = payload
    if spec.start_method == "forkserver":
        as_if_spawned(spec.environ)
        die_with_parent(os.getppid())  # the forkserver, which exits when the launching process does
    else:
        parent = multiprocessing.parent_process()
        die_with_parent(parent.pid if parent is not None else None)
    children_die_with_this_process()
    try:
        env = TorchElasticEnvironment()
    except BaseException as exc:
        write_record(spec.failure_dir, exc)
        raise
    return run_as_rank(env, spec, args)


def as_if_spawned(environ: dict[str, str] | None) -> None:
    """Make a worker forked by the forkserver start as a spawned one does.

    Its environment becomes the launching process's at the launch plus what
    torch's launcher set for this rank (``RANK``, ...), instead of the one the
    forkserver started with; numpy's global generator is seeded afresh (Python's
    ``random`` reseeds itself after a fork).
    """
    if environ is not None:
        current = dict(os.environ)
        if os.getpid() != _IMPORTED_IN:  # preloaded by the forkserver: what differs from its environment is the rank's
            launched = {k: v for k, v in current.items() if _FORKSERVER_ENVIRON.get(k) != v}
        else:  # a forkserver someone else started: keep what the launching process lacked
            launched = {k: v for k, v in current.items() if k not in environ}
        os.environ.clear()
        os.environ.update(environ)
        os.environ.update(launched)
    np.random.seed()


def limit_threads(local_world_size: int | None) -> int:
    """Share this node's CPU cores among the job's ``local_world_size`` processes on it.

    Sets ``torch.set_num_threads(max(1, cores // local_world_size))``, where
    ``cores`` are the cores this process may run on, unless ``OMP_NUM_THREADS``
    is set (it wins) or the local world size is unknown (``None``: torch's
    default is kept). The thread count changes the last bits of floating-point
    sums, so bit-identical runs need the same count.

    Returns:
        The number of intra-op threads torch uses afterwards.
    """
    if not os.environ.get("OMP_NUM_THREADS") and local_world_size is not None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, local_world_size)))
    return torch.get_num_threads()


def pickled(spec: WorkerSpec, args: tuple[Any, ...]) -> bytes:
    """``(spec, args)`` pickled once.

    Raises:
        TypeError: something cannot be pickled (the message says what to do).
    """
    try:
        return pickle.dumps((spec, args))
    except Exception as exc:
        raise TypeError(
            f"launch() sends fn and its arguments to new processes with pickle, and pickling failed: {exc}. "
            "Define fn at the top level of a module (not a lambda or a nested function) and pass picklable "
            "arguments, or use start_method='fork'."
        ) from exc


def warn_ignored_nprocs(env: ClusterEnvironment, nprocs: int | None) -> None:
    if nprocs is not None and nprocs > 1:
        warnings.warn(
            f"nprocs={nprocs} is ignored: the {env.name} environment already started {env.world_size()} processes "
            "for this job, and each runs the work once (unset its variables, or set DDPKIT_CLUSTER_ENV=local, "
            "to spawn processes here instead)",
            RuntimeWarning,
            stacklevel=3,
        )


def torchrun_variables(env: ClusterEnvironment) -> dict[str, str]:
    """The variables a torchrun worker sees, from a scheduler's environment."""
    return {
        "RANK": str(env.global_rank()),
        "WORLD_SIZE": str(env.world_size()),
        "LOCAL_RANK": str(env.local_rank()),
        "MASTER_ADDR": str(env.master_address()),
        "MASTER_PORT": str(env.master_port()),
    }
