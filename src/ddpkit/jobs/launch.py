"""Start N worker processes per node through PyTorch's elastic launcher: ``launch`` and ``run_script``.

ddpkit writes no launcher and no rendezvous of its own: :func:`launch` drives
``torch.distributed.launcher.api.elastic_launch`` and :func:`run_script`
drives ``torch.distributed.run`` (torchrun). What ddpkit adds:

* loopback and a free port by default, and nothing listens beyond this machine:
  torch's stores listen on every interface, so for a loopback rendezvous the
  agent's store and each attempt's process-group store are bound to the loopback
  address (:mod:`ddpkit._stores`); gloo is pinned to the loopback interface;
* under a scheduler that already started the job's processes (``srun``,
  ``mpirun``, torchrun, a Kubeflow or LSF job: ``scheduler_environment``),
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

import importlib.util
import multiprocessing
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from ddpkit.environments.base import check_resolves
from ddpkit.hangs._watchdog import TIMEOUT_VARIABLE, hang_timeout
from ddpkit.jobs._agent import (
    agent_scope,
    check_counts,
    default_nprocs,
    node_range,
    rdzv_configs,
    rendezvous,
    rendezvous_store,
    shutdown_grace,
    translated_failures,
)
from ddpkit.jobs._rendezvous import BACKEND as RENDEZVOUS_BACKEND
from ddpkit.jobs._worker import (
    WorkerSpec,
    limit_threads,
    pickled,
    run_in_this_task,
    scheduler_environment,
    torchrun_variables,
    warn_ignored_nprocs,
    worker_entry,
)

__all__ = ["check_target", "launch", "run_script", "scheduler_environment"]

StartMethod = Literal["spawn", "fork", "forkserver"]
T = TypeVar("T")
#: The pickled function and arguments, in the launch's private directory (beside the failure records).
_PAYLOAD_FILE = "payload.pickle"


def launch(
    fn: Callable[..., T],
    *args: Any,
    nprocs: int | None = None,
    nnodes: int | str = 1,
    max_restarts: int = 0,
    backend: str | None = None,
    rdzv_endpoint: str | None = None,
    start_method: StartMethod = "spawn",
    timeout: float | None = None,
    run_id: str | None = None,
    join_timeout: float | None = None,
    rdzv_conf: Mapping[str, Any] | str | None = None,
    **kwargs: Any,
) -> dict[int, T]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` new processes per node, as one DDP job.

    Each worker initialises the default process group (through
    :func:`~ddpkit.init_dist_connection`, gloo on CPU, NCCL on a rank that owns
    a GPU) before calling ``fn`` and destroys it afterwards, so ``fn`` can use
    collectives straight away. Call it under ``if __name__ == "__main__":``.

    Args:
        fn: a function defined at module top level (it is pickled to the workers).
        *args: positional arguments, as ``**kwargs``.
        **kwargs: passed to ``fn``; they must be picklable. Each worker
            gets its own copy (tensors included: nothing is shared in memory).
        nprocs: workers per node; default the number of CUDA devices, or 1 without CUDA.
        nnodes: number of nodes; above 1, run ``launch`` on every node with the
            same ``rdzv_endpoint`` and ``run_id``. ``"MIN:MAX"`` (torchrun's
            syntax) makes the job elastic: it starts with the nodes that join
            (at least ``MIN``), goes on while at least ``MIN`` are up, and takes
            in nodes that join later, up to ``MAX``; each change restarts the
            workers with the new world size (see :class:`~ddpkit.TrainLoop`'s
            ``global_batch_size`` for training that does not notice).
        max_restarts: how many times the agent restarts all workers after one
            fails (a node lost counts as a failure; a node that joins does
            not). Restarted workers start ``fn`` afresh; resume from a
            checkpoint to keep the work done.
        backend: process-group backend; ``None`` chooses as ``init_dist_connection`` does.
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous; default a free port on
            127.0.0.1 (single node only).
        start_method: how workers start. ``"spawn"`` (default): each worker is
            a fresh interpreter (safe with CUDA and threads). ``"forkserver"``
            (Linux, macOS): a clean server process (no threads, no CUDA) imports
            torch and ddpkit once and each worker is forked from it, so workers,
            restarts and later launches from this process skip those imports
            (about 2 s per worker here); a worker still imports the main module
            as a spawned one does and sees this process's environment as at
            the call. Its cost: a worker killed by a signal (SIGKILL, the OOM
            killer) is reaped by the server, so the error may name the rank
            that lost its connection to it instead. ``"fork"``: forks this
            process (unsafe once it has threads or CUDA).
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
        rdzv_conf: more of torch's rendezvous settings, as a mapping or as
            torchrun's ``--rdzv-conf`` text ``"KEY=VALUE,..."``, e.g. ``last_call_timeout`` (seconds an elastic job
            waits for more nodes once ``MIN`` have joined; default 30) and
            ``keep_alive_interval`` / ``keep_alive_max_attempt`` (a node is
            counted lost after missing this many heartbeats this many seconds
            apart; default 5 s x 3).

    Under a scheduler that already started this job's processes
    (``scheduler_environment``: ``srun``, ``mpirun``, torchrun, ...) nothing
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
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _check_missing_main_guard()
    hang_timeout(timeout)  # a bad value raises here, not in every worker
    scheduler = scheduler_environment()
    if scheduler is not None:
        spec = WorkerSpec(fn, "", dict(kwargs), backend, timeout)
        return run_in_this_task(scheduler, spec, args, nprocs)
    nprocs = default_nprocs() if nprocs is None else nprocs
    check_counts(nprocs, max_restarts)
    min_nodes, max_nodes = node_range(nnodes)
    configs = rdzv_configs(join_timeout, rdzv_conf)
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method={start_method!r} must be 'spawn', 'fork' or 'forkserver'")
    if start_method == "forkserver":
        start_forkserver()
    endpoint, rdzv_id, local_addr = rendezvous(nnodes, rdzv_endpoint, run_id)
    with agent_scope(nnodes) as failure_dir, rendezvous_store(endpoint, nnodes, configs, rdzv_id) as endpoint:
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nproc_per_node=nprocs,
            run_id=rdzv_id,
            rdzv_backend=RENDEZVOUS_BACKEND,
            rdzv_endpoint=endpoint,
            max_restarts=max_restarts,
            monitor_interval=0.1,
            start_method=start_method,
            local_addr=local_addr,
            rdzv_configs=configs,
            **shutdown_grace(),
        )
        spec = WorkerSpec(fn, failure_dir, dict(kwargs), backend, timeout, start_method, dict(os.environ))
        payload: Any = (spec, args)
        if start_method != "fork":
            # A file of plain pickle, not the objects: torch's multiprocessing pickler would move every
            # CPU tensor into shared memory (all workers training ONE set of weights, racing), and a large
            # payload written down each spawn pipe blocks until that child has started, one at a time.
            payload = os.path.join(failure_dir, _PAYLOAD_FILE)
            with open(payload, "wb") as handle:
                handle.write(pickled(spec, args))
        with translated_failures(failure_dir, endpoint, nnodes, join_timeout):
            results: dict[int, T] = elastic_launch(config, worker_entry)(payload)
    return results


#: What the forkserver imports before forking workers (see :func:`start_forkserver`).
FORKSERVER_PRELOAD = ["torch", "ddpkit"]


def start_forkserver(*also: str) -> None:
    """Start this process's forkserver now, importing :data:`FORKSERVER_PRELOAD` and ``also`` (module names).

    It starts once per process (later calls add nothing) and imports in the
    background while the launch sets up its rendezvous; the workers fork from
    it with those modules imported.
    """
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*FORKSERVER_PRELOAD, *also])
    forkserver.ensure_running()


def run_script(
    script: str,
    script_args: Sequence[str] = (),
    *,
    nprocs: int | None = None,
    nnodes: int | str = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    module: bool = False,
    join_timeout: float | None = None,
    timeout: float | None = None,
    rdzv_conf: Mapping[str, Any] | str | None = None,
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
    (``scheduler_environment``), the script runs in this process instead,
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
        FileNotFoundError: ``script`` is not a file (with ``module=True``: no module of that name is found),
            checked before any worker starts.
    """
    from torch.distributed import run as torchrun

    check_target(script, module)
    deadline = hang_timeout(timeout)
    scheduler = scheduler_environment()
    if scheduler is not None:
        # Imported here: `python -m ddpkit.jobs._script_runner` must not find it imported already.
        from ddpkit.jobs._script_runner import run_target

        warn_ignored_nprocs(scheduler, nprocs)
        check_resolves(scheduler.master_address(), scheduler.master_address_source())
        limit_threads(scheduler.local_world_size())
        os.environ.update(torchrun_variables(scheduler))
        os.environ[TIMEOUT_VARIABLE] = str(deadline or 0)
        run_target(script, list(script_args), as_module=module)
        return
    nprocs = default_nprocs() if nprocs is None else nprocs
    check_counts(nprocs, max_restarts)
    min_nodes, max_nodes = node_range(nnodes)
    configs = rdzv_configs(join_timeout, rdzv_conf)
    endpoint, rdzv_id, local_addr = rendezvous(nnodes, rdzv_endpoint, run_id)
    with agent_scope(nnodes) as failure_dir, rendezvous_store(endpoint, nnodes, configs, rdzv_id) as endpoint:
        os.environ[TIMEOUT_VARIABLE] = str(deadline or 0)  # read by every worker's watchdog
        argv = [
            f"--nnodes={min_nodes}:{max_nodes}",
            f"--nproc-per-node={nprocs}",
            f"--rdzv-backend={RENDEZVOUS_BACKEND}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--max-restarts={max_restarts}",
            *(f"--shutdown-timeout={value}" for value in shutdown_grace().values()),
        ]
        if configs:
            argv.append("--rdzv-conf=" + ",".join(f"{key}={value}" for key, value in configs.items()))
        if local_addr:
            argv.append(f"--local-addr={local_addr}")
        # Every worker runs `python -u -m ddpkit.jobs._script_runner [-m] script args`: the script
        # itself, plus a failure record that tells which rank failed first.
        argv += ["--module", "ddpkit.jobs._script_runner", *(["-m"] if module else []), script, *script_args]
        with translated_failures(failure_dir, endpoint, nnodes, join_timeout):
            torchrun.run(torchrun.parse_args(argv))  # type: ignore[no-untyped-call]


def check_target(script: str, module: bool = False) -> None:
    """Raise unless ``script`` names a file (or, with ``module``, a module importable from here or the current
    directory), so that a typo fails once, here, not in every worker.

    Raises:
        FileNotFoundError: naming what was looked for and where.
    """
    if not module:
        if not os.path.isfile(script):
            where = "" if os.path.isabs(script) else f" (relative to {os.getcwd()})"
            raise FileNotFoundError(f"no such script: {script}{where}")
        return
    sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(script) is not None
    except (ImportError, ValueError):
        found = False
    finally:
        sys.path.pop(0)
    if not found:
        raise FileNotFoundError(f"no module named {script!r} (looked on sys.path and in {os.getcwd()})")


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
