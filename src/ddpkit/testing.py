"""Test distributed code in pytest on a CPU: ``run_parallel(fn)`` runs ``fn`` on N gloo ranks.

The ranks are worker processes spawned once and kept for the whole test
session (one pool per world size), each with its gloo process group
initialised once through a ``file://`` store in a temporary directory (no
port), ``torch.set_num_threads(1)`` and ``faulthandler`` on. Each rank has its
own task pipe and result pipe, so a task is pinned to its rank. A hundred
two-rank tests take seconds this way, against seconds *per test* when every
test spawns its own processes.

Deadlines are layered so that a hang costs seconds, not gloo's default 30
minutes: the process-group timeout (15 s) < ``run_parallel``'s ``timeout``
(30 s) < pytest-timeout (60 s in our configuration) < CI.

Example, in a test module::

    import torch
    import torch.distributed as dist
    from ddpkit.testing import run_parallel

    def _sum_of_ranks() -> float:          # top level: it is pickled to the workers
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_all_reduce_sums_ranks():
        assert run_parallel(_sum_of_ranks, world_size=3) == [3.0, 3.0, 3.0]

Return values and assert in the test, not inside ``fn``: the workers import
test modules without pytest's assertion rewriting, so a bare ``assert`` there
loses its explanation. To check that every rank raises, catch inside ``fn`` and
return what was caught.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._backends import pin_gloo_to_loopback
from ddpkit._orphans import die_with_parent
from ddpkit.errors import WorkerFailedError

__all__ = ["PROCESS_GROUP_TIMEOUT_S", "close_pools", "run_parallel"]

#: Timeout of the pool workers' process groups, in seconds (a blocked collective raises after it).
PROCESS_GROUP_TIMEOUT_S = 15.0
#: Seconds the other ranks get to answer once one rank has raised; then the pool is killed.
_GRACE_S = 3.0
#: Seconds a new pool may take to spawn, import torch and form its group.
_STARTUP_TIMEOUT_S = 120.0
# Variables that place a process in some other job: a pool worker must not inherit them.
_PLACEMENT_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "TORCHELASTIC_", "JSM_", "LSB_", "GROUP_")
_PLACEMENT_NAMES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "NODE_RANK", "DDPKIT_CLUSTER_ENV")


def run_parallel(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = 30.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on every rank of a ``world_size``-rank gloo group; return the results.

    Args:
        fn: a function defined at the top level of an importable module (it is
            pickled to the workers); it finds its rank with ``dist.get_rank()``.
        *args: positional arguments, as ``**kwargs``.
        **kwargs: picklable arguments, the same for every rank.
        world_size: number of ranks (default 2); one pool per world size is kept.
        timeout: seconds every rank has to finish (default 30).

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; results must be picklable.

    Raises:
        Exception: the exception the lowest failing rank raised (same type, same
            message), chained to a text with every failing rank's traceback.
        TimeoutError: some rank did not finish within ``timeout``; the stacks of
            the stuck ranks are dumped to stderr first.
        WorkerFailedError: a rank died (e.g. a C++ abort), or its exception or
            result could not be sent back.
        TypeError: ``fn`` or its arguments cannot be pickled.

    After any error or missed deadline the pool is killed; the next call spawns a
    fresh one. A task that destroys the default process group also retires the
    pool. Each task's changes to ``os.environ`` are undone in the workers.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    try:
        blob = pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_parallel pickles fn and its arguments to the workers, and pickling failed: {exc}. "
            "Define fn at the top level of a module (not a lambda or a nested function)."
        ) from exc
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(getattr(fn, "__qualname__", repr(fn)), blob, timeout)
    except BaseException:
        pool.close()
        _POOLS.pop(world_size, None)
        raise


def close_pools() -> None:
    """Kill every pool's workers (also done at interpreter exit)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


# One pool per world size, kept for the session on purpose (see the module docstring).
_POOLS: dict[int, _Pool] = {}
atexit.register(close_pools)


class _RemoteTracebackError(Exception):
    """The worker-side tracebacks of a failed :func:`run_parallel` task."""


class _Pool:
    """``world_size`` spawned workers with one gloo group, driven through one pipe pair per rank."""

    def __init__(self, world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.world_size = world_size
        self._directory = tempfile.mkdtemp(prefix="ddpkit-pool-")
        store = os.path.join(self._directory, "store")
        self._tasks: list[Connection] = []
        self._results: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._next_task = 1
        for rank in range(world_size):
            task_reader, task_writer = context.Pipe(duplex=False)
            result_reader, result_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=_worker_main,
                args=(rank, world_size, store, PROCESS_GROUP_TIMEOUT_S, task_reader, result_writer),
                name=f"ddpkit-pool-{world_size}-rank{rank}",
                daemon=True,
            )
            process.start()
            task_reader.close()
            result_writer.close()
            self._tasks.append(task_writer)
            self._results.append(result_reader)
            self._processes.append(process)
        try:
            replies = self._collect(0, time.monotonic() + _STARTUP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        failed = {rank: reply for rank, reply in replies.items() if reply[0] != "ok"}
        if failed or len(replies) < world_size:
            self.close()
            details = "; ".join(f"rank {r}: {reply[2]['error']}" for r, reply in sorted(failed.items()))
            raise WorkerFailedError(
                min(failed, default=0), 1, f"the {world_size}-rank test pool did not start: {details or 'timed out'}"
            )

    def alive(self) -> bool:
        return all(process.is_alive() for process in self._processes)

    def run(self, name: str, blob: bytes, timeout: float) -> list[Any]:
        task_id, self._next_task = self._next_task, self._next_task + 1
        for connection in self._tasks:
            connection.send((task_id, blob))
        replies = self._collect(task_id, time.monotonic() + timeout)
        missing = [rank for rank in range(self.world_size) if rank not in replies]
        errors = {rank: reply for rank, reply in replies.items() if reply[0] != "ok"}
        if missing:
            self._dump_stacks(missing)
        if missing or errors:
            self.close()
            raise _task_error(name, timeout, replies, missing)
        results = [pickle.loads(replies[rank][2]) for rank in range(self.world_size)]
        if not all(reply[3] for reply in replies.values()):
            self.close()  # the task destroyed the process group: retire this pool
        return results

    def _collect(self, task_id: int, deadline: float) -> dict[int, tuple[Any, ...]]:
        """Replies to ``task_id`` by rank, until all arrived, the deadline passed, or the grace after an error."""
        replies: dict[int, tuple[Any, ...]] = {}
        limit = deadline
        while len(replies) < self.world_size:
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waiting = {self._results[r]: r for r in range(self.world_size) if r not in replies}
            sentinels = {self._processes[r].sentinel: r for r in waiting.values()}
            for ready in wait([*waiting, *sentinels], timeout=remaining):
                rank = waiting[ready] if ready in waiting else sentinels[ready]  # type: ignore[index]
                if rank in replies:
                    continue
                connection = self._results[rank]
                if ready in sentinels and not connection.poll():
                    replies[rank] = self._death(rank, task_id)
                    continue
                try:
                    reply = connection.recv()
                except (EOFError, OSError):
                    replies[rank] = self._death(rank, task_id)
                    continue
                if reply[1] == task_id:
                    replies[rank] = reply
            if any(reply[0] != "ok" for reply in replies.values()):
                limit = min(limit, time.monotonic() + _GRACE_S)
        return replies

    def _death(self, rank: int, task_id: int) -> tuple[Any, ...]:
        process = self._processes[rank]
        process.join(timeout=5)
        code = process.exitcode
        return ("died", task_id, {"error": f"the worker process died (exit code {code})", "exitcode": code}, False)

    def _dump_stacks(self, ranks: list[int]) -> None:
        if not hasattr(signal, "SIGUSR1"):
            return
        for rank in ranks:
            process = self._processes[rank]
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGUSR1)
        time.sleep(0.5)

    def close(self) -> None:
        for process in self._processes:
            if process.is_alive():
                process.kill()
        for process in self._processes:
            process.join(timeout=10)
        for connection in (*self._tasks, *self._results):
            connection.close()
        shutil.rmtree(self._directory, ignore_errors=True)


def _task_error(name: str, timeout: float, replies: dict[int, tuple[Any, ...]], missing: list[int]) -> BaseException:
    """The exception :func:`run_parallel` raises for a failed task."""
    errors = {rank: reply[2] for rank, reply in sorted(replies.items()) if reply[0] != "ok"}
    stuck = f"rank(s) {', '.join(map(str, missing))} did not finish" if missing else ""
    if not errors:
        return TimeoutError(
            f"run_parallel({name}): {stuck} within {timeout} s; their stacks were dumped to stderr "
            f"(faulthandler); rank(s) {', '.join(map(str, sorted(replies))) or 'none'} finished"
        )
    sections = [f"rank {rank}: {info.get('traceback') or info['error']}" for rank, info in errors.items()]
    if stuck:
        sections.append(f"{stuck} within {_GRACE_S} s after the first error and were killed")
    cause = _RemoteTracebackError(f"run_parallel({name}) failed:\n" + "\n".join(sections))
    rank, info = next(iter(errors.items()))
    if info.get("exception") is not None:
        try:
            exc: BaseException = pickle.loads(info["exception"])
        except Exception:
            pass
        else:
            exc.__cause__ = cause
            return exc
    failures = {r: str(i["error"]) for r, i in errors.items()}
    exitcode = info.get("exitcode")
    error = WorkerFailedError(
        rank, exitcode if isinstance(exitcode, int) else 1, f"run_parallel({name}): {info['error']}", failures=failures
    )
    error.__cause__ = cause
    return error


# --- inside a worker ----------------------------------------------------------------------


def _worker_main(
    rank: int, world_size: int, store: str, pg_timeout: float, tasks: Connection, results: Connection
) -> None:
    parent = multiprocessing.parent_process()
    die_with_parent(parent.pid if parent is not None else None)
    # Tasks may start DataLoader workers, which multiprocessing refuses to a daemon process. This worker
    # dies with its parent anyway (above), and DataLoader workers watch theirs.
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.set_num_threads(1)
    for name in list(os.environ):
        if name.startswith(_PLACEMENT_PREFIXES) or name in _PLACEMENT_NAMES:
            del os.environ[name]
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        pin_gloo_to_loopback()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
    except BaseException as exc:
        results.send(("error", 0, _describe(exc), False))
        return
    results.send(("ok", 0, pickle.dumps(None), True))
    baseline = dict(os.environ)
    while True:
        try:
            task_id, blob = tasks.recv()
        except (EOFError, OSError):
            return
        try:
            fn, args, kwargs = pickle.loads(blob)
            reply: tuple[Any, ...] = ("ok", task_id, pickle.dumps(fn(*args, **kwargs)))
        except BaseException as exc:
            reply = ("error", task_id, _describe(exc))
        finally:
            os.environ.clear()
            os.environ.update(baseline)
        healthy = dist.is_initialized()
        results.send((*reply, healthy))
        if not healthy:
            return


def _describe(exc: BaseException) -> dict[str, Any]:
    pickled: bytes | None
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt
    except Exception:
        pickled = None
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(exc)),
        "exception": pickled,
    }
