"""Start N worker processes per node through PyTorch's elastic launcher (layer 5).

ddpkit writes no launcher and no rendezvous of its own: :func:`launch` drives
``torch.distributed.launcher.api.elastic_launch`` and :func:`run_script`
drives ``torch.distributed.run`` (torchrun). What ddpkit adds:

* loopback and a free port by default, and nothing listens beyond this machine:
  torch's stores listen on every interface, so for a loopback rendezvous the
  agent's store and each attempt's process-group store are bound to the loopback
  address (:mod:`ddpkit._stores`); gloo is pinned to the loopback interface;
* under a scheduler that already started the job's processes (``srun``,
  ``mpirun``, torchrun, a Kubeflow or LSF job: :func:`scheduler_environment`),
  nothing is spawned: ``fn`` or the script runs once in each of those processes;
* restarts that work: on torch 2.13 a restarted attempt's
  ``init_process_group`` finds the previous attempt's keys in the agent's shared
  rendezvous store and fails to connect (plain ``torchrun --max-restarts 1``
  failed 4 times out of 4 here). Each attempt gets its own store instead
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for the agent: rank 0 of each attempt
  hosts a fresh store on a fresh port);
* a failing worker becomes one :class:`~ddpkit.WorkerFailedError` naming the
  rank, with its error text and traceback, after the agent has stopped every
  other worker;
* the caller's signal handlers and environment are restored afterwards.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import textwrap
import threading
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ddpkit._failures import FAILURE_DIR_VARIABLE, read_records, worker_failed_error, write_record
from ddpkit._orphans import children_die_with_this_process, die_with_parent
from ddpkit._stores import release_loopback_store, serve_on_loopback
from ddpkit._watchdog import TIMEOUT_VARIABLE, hang_timeout
from ddpkit.environments import ClusterEnvironment, TorchElasticEnvironment, detect_environment, is_loopback
from ddpkit.environments.base import check_resolves
from ddpkit.errors import ClusterEnvironmentError, RendezvousFailedError
from ddpkit.process_group import barrier, destroy_dist_connection, init_dist_connection

__all__ = ["launch", "run_script", "scheduler_environment"]

StartMethod = Literal["spawn", "fork", "forkserver"]

# Seconds the agent waits after SIGTERM before it SIGKILLs the remaining workers.
_SHUTDOWN_GRACE_S = 5
# Environment variables the elastic agent reads or writes in the launching process.
_AGENT_ENV = (
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "OMP_NUM_THREADS",
    FAILURE_DIR_VARIABLE,
    TIMEOUT_VARIABLE,
)
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
#: The pickled function and arguments, in the launch's private directory (beside the failure records).
_PAYLOAD_FILE = "payload.pickle"


@dataclass(frozen=True)
class _WorkerSpec:
    """What each worker process needs besides the positional arguments (pickled once per worker)."""

    fn: Callable[..., Any]
    failure_dir: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    backend: str | None = None
    timeout: float | None = None


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nprocs: int | None = None,
    nnodes: int = 1,
    max_restarts: int = 0,
    backend: str | None = None,
    rdzv_endpoint: str | None = None,
    start_method: StartMethod = "spawn",
    timeout: float | None = None,
    run_id: str | None = None,
    join_timeout: float | None = None,
    **kwargs: Any,
) -> dict[int, Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` new processes per node, as one DDP job.

    Each worker initialises the default process group (through
    :func:`~ddpkit.init_dist_connection`, gloo on CPU, NCCL on a rank that owns
    a GPU) before calling ``fn`` and destroys it afterwards, so ``fn`` can use
    collectives straight away. Call it under ``if __name__ == "__main__":``.

    Args:
        fn: a function defined at module top level (it is pickled to the workers).
        *args, **kwargs: passed to ``fn``; they must be picklable. Each worker
            gets its own copy (tensors included: nothing is shared in memory).
        nprocs: workers per node; default the number of CUDA devices, or 1 without CUDA.
        nnodes: number of nodes; above 1, run ``launch`` on every node with the
            same ``rdzv_endpoint`` and ``run_id``.
        max_restarts: how many times the agent restarts all workers after one
            fails. Restarted workers start ``fn`` afresh; resume from a checkpoint
            to keep the work done.
        backend: process-group backend; ``None`` chooses as ``init_dist_connection`` does.
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous; default a free port on
            127.0.0.1 (single node only).
        start_method: ``"spawn"`` (default, safe with CUDA and threads),
            ``"forkserver"`` or ``"fork"``.
        timeout: seconds a rank may wait in one collective before the job counts
            as hung (default 300, or ``DDPKIT_HANG_TIMEOUT``; ``0`` turns the
            watchdog off): the job then stops and :class:`~ddpkit.HangError`
            names the rank(s) that did not arrive, every rank's collective and
            Python stack, and the full report's file. With ``max_restarts`` a
            hang is a failure like any other: the workers restart. The process
            group's own timeout is at least this plus 60 s.
        run_id: rendezvous id shared by the nodes of one job; default a fresh
            id (single node) or ``"ddpkit"`` (several nodes).
        join_timeout: seconds the nodes have to join the rendezvous (torch's
            default 600); the launch fails after that naming how many arrived.

    Under a scheduler that already started this job's processes
    (:func:`scheduler_environment`: ``srun``, ``mpirun``, torchrun, ...) nothing
    is spawned: ``fn`` runs in this process, on its own copy of the arguments,
    as one rank of the scheduler's tasks; ``nprocs``, ``nnodes`` and the
    rendezvous arguments are ignored, and an exception of ``fn`` propagates
    unchanged (the scheduler stops the other tasks: use ``srun
    --kill-on-bad-exit=1``).

    Threads: each worker (or scheduler task) uses ``cores // processes on its
    node`` intra-op threads, unless ``OMP_NUM_THREADS`` is set. Results are
    bit-identical between runs with the same world size, thread count and
    hardware; a different thread count changes the last bits of sums.

    Returns:
        ``{global rank: fn's return value}`` for this node's workers (under a
        scheduler: for this process).

    Raises:
        HangError: the job hung past ``timeout`` (after ``max_restarts`` restarts);
            a :class:`~ddpkit.WorkerFailedError`.
        WorkerFailedError: a worker raised or died (after ``max_restarts``
            restarts); every worker has been stopped when it is raised, and it
            names the first failing rank with its error text and traceback.
        RendezvousFailedError: the nodes did not all join within ``join_timeout``,
            or ``rdzv_endpoint`` names a host that does not resolve.
        PortTakenError: the loopback rendezvous port is held by another program.
        TypeError: ``fn`` or the arguments cannot be pickled (a lambda, a nested
            function) with ``spawn``/``forkserver``.
        ValueError: ``nprocs``, ``nnodes`` or ``max_restarts`` out of range, or
            several nodes without ``rdzv_endpoint``.
        RuntimeError: called while a script without a ``__main__`` guard is being
            re-imported by a spawned worker (the message shows the fix).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _check_missing_main_guard()
    hang_timeout(timeout)  # a bad value raises here, not in every worker
    scheduler = scheduler_environment()
    if scheduler is not None:
        spec = _WorkerSpec(fn, "", dict(kwargs), backend, timeout)
        return _run_in_this_task(scheduler, spec, args, nprocs)
    nprocs = _default_nprocs() if nprocs is None else nprocs
    _check_counts(nprocs, nnodes, max_restarts)
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method={start_method!r} must be 'spawn', 'fork' or 'forkserver'")
    endpoint, rdzv_id, local_addr = _rendezvous(nnodes, rdzv_endpoint, run_id)
    with _agent_scope() as failure_dir, _rendezvous_store(endpoint, nnodes) as endpoint:
        config = LaunchConfig(
            min_nodes=nnodes,
            max_nodes=nnodes,
            nproc_per_node=nprocs,
            run_id=rdzv_id,
            rdzv_backend="c10d",
            rdzv_endpoint=endpoint,
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=start_method,
            local_addr=local_addr,
            shutdown_timeout=_SHUTDOWN_GRACE_S,
            rdzv_configs={} if join_timeout is None else {"join_timeout": max(1, round(join_timeout))},
        )
        spec = _WorkerSpec(fn, failure_dir, dict(kwargs), backend, timeout)
        payload: Any = (spec, args)
        if start_method != "fork":
            # A file of plain pickle, not the objects: torch's multiprocessing pickler would move every
            # CPU tensor into shared memory (all workers training ONE set of weights, racing), and a large
            # payload written down each spawn pipe blocks until that child has started, one at a time.
            payload = os.path.join(failure_dir, _PAYLOAD_FILE)
            with open(payload, "wb") as handle:
                handle.write(_pickled(spec, args))
        try:
            results: dict[int, Any] = elastic_launch(config, _worker_entry)(payload)
        except ChildFailedError as err:
            _release_frames(err)
            raise worker_failed_error(err, read_records(failure_dir)) from err
        except RendezvousError as err:
            _release_frames(err)
            raise _rendezvous_failed(err, endpoint, nnodes, join_timeout) from err
    return results


def run_script(
    script: str,
    script_args: Sequence[str] = (),
    *,
    nprocs: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    module: bool = False,
    join_timeout: float | None = None,
    timeout: float | None = None,
) -> None:
    """Run a torchrun-style script (``python script.py args``) on ``nprocs`` processes per node.

    The script runs unchanged: it reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` and calls ``init_process_group`` itself
    (or :func:`~ddpkit.init_dist_connection`). This is ``ddpkit run``; it uses
    ``torch.distributed.run`` underneath, with the defaults and restart fix
    described in this module. Arguments as for :func:`launch`; ``module=True``
    runs ``python -m script``. ``node_rank`` is accepted as torchrun accepts it,
    and unused: the c10d rendezvous numbers the nodes as they join.

    Under a scheduler that already started this job's processes
    (:func:`scheduler_environment`), the script runs in this process instead,
    with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set from the scheduler's variables.

    ``timeout`` is the hang deadline of :func:`launch` (seconds in one
    collective; default 300): each worker watches its collectives from the
    moment its script creates the default process group (even with a plain
    ``init_process_group``).

    Raises:
        HangError: the job hung past ``timeout``.
        WorkerFailedError: a worker exited non-zero or died (after ``max_restarts``
            restarts); its traceback is in its stderr unless it used ``@record``.
        RendezvousFailedError: the nodes did not all join within ``join_timeout``.
        PortTakenError: the loopback rendezvous port is held by another program.
        ValueError: counts out of range, or several nodes without ``rdzv_endpoint``.
    """
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    deadline = hang_timeout(timeout)
    scheduler = scheduler_environment()
    if scheduler is not None:
        # Imported here: `python -m ddpkit._script_runner` must not find it imported already.
        from ddpkit._script_runner import run_target

        _warn_ignored_nprocs(scheduler, nprocs)
        check_resolves(scheduler.master_address(), scheduler.master_address_source())
        _limit_threads(scheduler.local_world_size())
        os.environ.update(_torchrun_variables(scheduler))
        os.environ[TIMEOUT_VARIABLE] = str(deadline or 0)
        run_target(script, list(script_args), as_module=module)
        return
    nprocs = _default_nprocs() if nprocs is None else nprocs
    _check_counts(nprocs, nnodes, max_restarts)
    endpoint, rdzv_id, local_addr = _rendezvous(nnodes, rdzv_endpoint, run_id)
    with _agent_scope() as failure_dir, _rendezvous_store(endpoint, nnodes) as endpoint:
        os.environ[TIMEOUT_VARIABLE] = str(deadline or 0)  # read by every worker's watchdog
        argv = [
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nprocs}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}",
            f"--shutdown-timeout={_SHUTDOWN_GRACE_S}",
        ]
        if join_timeout is not None:
            argv.append(f"--rdzv-conf=join_timeout={max(1, round(join_timeout))}")
        if local_addr:
            argv.append(f"--local-addr={local_addr}")
        # Every worker runs `python -u -m ddpkit._script_runner [-m] script args`: the script
        # itself, plus a failure record that tells which rank failed first.
        argv += ["--module", "ddpkit._script_runner", *(["-m"] if module else []), script, *script_args]
        try:
            torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]
        except ChildFailedError as err:
            _release_frames(err)
            raise worker_failed_error(err, read_records(failure_dir)) from err
        except RendezvousError as err:
            _release_frames(err)
            raise _rendezvous_failed(err, endpoint, nnodes, join_timeout) from err


def scheduler_environment() -> ClusterEnvironment | None:
    """The cluster environment, when a scheduler already started this job's processes; else ``None``.

    That is: :func:`~ddpkit.detect_environment` reports processes created
    externally (``srun``, ``mpirun``, torchrun, a Kubeflow or LSF job, or
    ``RANK`` set by hand) and a world size above 1. :func:`launch` and
    :func:`run_script` then run in this process instead of spawning.
    """
    env = detect_environment()
    return env if env.creates_processes_externally and env.world_size() > 1 else None


def _run_in_this_task(
    env: ClusterEnvironment, spec: _WorkerSpec, args: tuple[Any, ...], nprocs: int | None
) -> dict[int, Any]:
    """:func:`launch` as one of a scheduler's tasks: group up, run ``fn`` once, group down."""
    _warn_ignored_nprocs(env, nprocs)
    _limit_threads(env.local_world_size())
    spec, args = pickle.loads(_pickled(spec, args))  # its own copy, as a spawned worker has
    init_dist_connection(env, spec.backend, hang_timeout=spec.timeout)
    try:
        result = spec.fn(*args, **spec.kwargs)
        barrier()  # rank 0 hosts the store: keep it up until every rank is done
    finally:
        destroy_dist_connection()
    return {int(env.global_rank()): result}


def _warn_ignored_nprocs(env: ClusterEnvironment, nprocs: int | None) -> None:
    if nprocs is not None and nprocs > 1:
        warnings.warn(
            f"nprocs={nprocs} is ignored: the {env.name} environment already started {env.world_size()} processes "
            "for this job, and each runs the work once (unset its variables, or set DDPKIT_CLUSTER_ENV=local, "
            "to spawn processes here instead)",
            RuntimeWarning,
            stacklevel=3,
        )


def _torchrun_variables(env: ClusterEnvironment) -> dict[str, str]:
    """The variables a torchrun worker sees, from a scheduler's environment."""
    return {
        "RANK": str(env.global_rank()),
        "WORLD_SIZE": str(env.world_size()),
        "LOCAL_RANK": str(env.local_rank()),
        "MASTER_ADDR": str(env.master_address()),
        "MASTER_PORT": str(env.master_port()),
    }


# --- inside a worker --------------------------------------------------------------------


def _worker_entry(payload: str | tuple[_WorkerSpec, tuple[Any, ...]]) -> Any:
    """Entry point of every worker: group up, run ``fn`` on its own copy of the arguments, group down."""
    spec: _WorkerSpec
    if isinstance(payload, str):
        with open(payload, "rb") as handle:
            spec, args = pickle.load(handle)
    else:
        spec, args = payload
    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None else None)
    children_die_with_this_process()
    env = TorchElasticEnvironment()
    _limit_threads(env.local_world_size())
    try:
        init_dist_connection(env, spec.backend, hang_timeout=spec.timeout)
        result = spec.fn(*args, **spec.kwargs)
        # Rank 0 hosts this attempt's store: keep it up until every rank is done.
        barrier()
        return result
    except BaseException as exc:
        write_record(spec.failure_dir, exc)
        raise
    finally:
        destroy_dist_connection()


def _limit_threads(local_world_size: int | None) -> int:
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


# --- in the launching process -----------------------------------------------------------


def _default_nprocs() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _check_counts(nprocs: int, nnodes: int, max_restarts: int) -> None:
    for name, value, low in (("nprocs", nprocs, 1), ("nnodes", nnodes, 1), ("max_restarts", max_restarts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def _rendezvous(nnodes: int, rdzv_endpoint: str | None, run_id: str | None) -> tuple[str, str, str | None]:
    """(endpoint, run id, local address) for the c10d rendezvous."""
    if nnodes > 1 and not rdzv_endpoint:
        raise ValueError(
            f"nnodes={nnodes} needs rdzv_endpoint='HOST:PORT', the same on every node "
            "(HOST is the machine that hosts the rendezvous, reachable from all nodes)"
        )
    # Port 0: the single agent binds a free port itself, with no window for a race.
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    local_addr = "127.0.0.1" if is_loopback(host) else None
    try:
        check_resolves(host, f"the host of rdzv_endpoint={endpoint!r}")
    except ClusterEnvironmentError as exc:
        raise RendezvousFailedError(str(exc)) from None
    return endpoint, run_id or ("ddpkit" if nnodes > 1 else uuid.uuid4().hex), local_addr


def _pickled(spec: _WorkerSpec, args: tuple[Any, ...]) -> bytes:
    try:
        return pickle.dumps((spec, args))
    except Exception as exc:
        raise TypeError(
            f"launch() sends fn and its arguments to new processes with pickle, and pickling failed: {exc}. "
            "Define fn at the top level of a module (not a lambda or a nested function) and pass picklable "
            "arguments, or use start_method='fork'."
        ) from exc


def _check_missing_main_guard() -> None:
    """Raise in a spawned child that is re-importing a script without a main guard."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    raise RuntimeError(
        textwrap.dedent(
            """\
            ddpkit.launch() was called while a new worker process was importing your script: the 'spawn'
            start method re-imports the main module in every worker. Guard the launching code:

                def main():
                    ...
                    ddpkit.launch(train, nprocs=2)

                if __name__ == "__main__":
                    main()
            """
        )
    )


@contextmanager
def _agent_scope() -> Iterator[str]:
    """Set up one launch: each restart attempt gets its own store, workers get a failure-record
    directory (yielded); afterwards, undo what the agent changed in this process."""
    saved_env = {name: os.environ.get(name) for name in _AGENT_ENV}
    saved_signals = _current_handlers()
    failure_dir = tempfile.mkdtemp(prefix="ddpkit-failures-")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[FAILURE_DIR_VARIABLE] = failure_dir
    try:
        yield failure_dir
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)


def _rendezvous_failed(err: Exception, endpoint: str, nnodes: int, join_timeout: float | None) -> RendezvousFailedError:
    waited = f"{join_timeout:g} s" if join_timeout is not None else "the join timeout (600 s by default)"
    detail = f" ({type(err).__name__}: {err})" if str(err) else f" ({type(err).__name__})"
    return RendezvousFailedError(
        f"the rendezvous at {endpoint} did not complete: this node waited {waited} for {nnodes} node(s) and fewer "
        f"joined{detail}. Start the same command on every node with the same rendezvous endpoint and id (and "
        f"nnodes={nnodes}), check that {endpoint} is reachable from each node and that no other program holds "
        "its port"
    )


def _release_frames(err: BaseException) -> None:
    """Clear the locals of the agent's finished frames in ``err``'s traceback.

    They hold the rendezvous store, whose server would otherwise keep listening
    for as long as the caller keeps the exception (the traceback still prints).
    """
    traceback.clear_frames(err.__traceback__)


@contextmanager
def _rendezvous_store(endpoint: str, nnodes: int) -> Iterator[str]:
    """Host the rendezvous store on the loopback address when the endpoint is loopback; yield the
    endpoint with its real port (a free one for port 0). With several nodes, another agent on this
    machine may host it already."""
    host, _, port = endpoint.rpartition(":")
    served = serve_on_loopback(host.strip("[]"), int(port), if_taken="peer" if nnodes > 1 else "raise")
    try:
        yield endpoint if served is None else f"{host}:{served}"
    finally:
        release_loopback_store(served)


def _current_handlers() -> dict[signal.Signals, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for name in _AGENT_SIGNALS if (sig := getattr(signal, name, None)) is not None}
