"""launch(): results by rank, a failing rank named within seconds, restarts, nothing left behind."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit import RendezvousFailedError, WorkerFailedError, launch
from ddpkit.jobs._worker import limit_threads
from tests.helpers import alive

# --- run in the workers (top level: pickled by reference) -----------------------------------


def _report(offset: int, weights: torch.Tensor, *, scale: int) -> dict[str, object]:
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    weights.add_(dist.get_rank() + 1)  # each rank's own copy: nothing shared behind DDP's back
    dist.barrier()
    return {
        "weights": weights.tolist(),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": total.item() * scale + offset,
        "threads": torch.get_num_threads(),
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def _fail_on_rank_one(directory: str) -> None:
    (Path(directory) / f"{os.getpid()}.pid").write_text(str(dist.get_rank()))
    dist.barrier()
    if dist.get_rank() == 1:
        raise ValueError("bad batch 17 on rank 1")
    dist.barrier()  # rank 0 waits here; only the launcher can end it


def _fail_first_attempt() -> tuple[int, bool, float]:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    store = dist.distributed_c10d._get_default_store()
    stale = store.check(["ddpkit-test-marker"])  # left by an earlier attempt?
    dist.barrier()
    if dist.get_rank() == 0:
        store.set("ddpkit-test-marker", str(attempt))
    total = torch.ones(1)
    dist.all_reduce(total)  # the group and its store are in use before the failure
    if attempt == 0 and dist.get_rank() == 1:
        raise RuntimeError("worker lost")
    return attempt, stale, total.item()


def _forked_worker() -> dict[str, object]:
    import numpy as np

    total = torch.ones(1)
    dist.all_reduce(total)
    return {
        "marker": os.environ.get("DDPKIT_TEST_MARKER"),
        "rank": os.environ["RANK"],
        "numpy": float(np.random.random()),
        "sum": total.item(),
        "parent": os.getppid(),
    }


# --- tests ------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_launch_returns_each_ranks_result_and_restores_the_caller() -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    weights = torch.zeros(2)
    results = launch(_report, 1, weights, nprocs=2, scale=10)
    cores = len(os.sched_getaffinity(0))
    threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, cores // 2))  # an exported OMP_NUM_THREADS wins
    assert weights.tolist() == [0.0, 0.0]
    assert results == {
        rank: {
            "weights": [rank + 1.0] * 2,
            "rank": rank,
            "world_size": 2,
            "sum": 31.0,
            "threads": threads,
            "gloo_interface": "lo",
        }
        for rank in (0, 1)
    }
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "the agent's signal handlers are undone"
    assert dict(os.environ) == environ, "the agent's environment changes are undone"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_forkserver_workers_start_as_spawned_ones_would(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's environment is the first launch's; a worker sees the caller's at its own launch, its rank's
    variables, a fresh numpy seed, and dies with the server (its parent), not at once."""
    monkeypatch.setenv("DDPKIT_TEST_MARKER", "first")
    first = launch(_forked_worker, nprocs=2, start_method="forkserver")
    monkeypatch.setenv("DDPKIT_TEST_MARKER", "second")
    second = launch(_forked_worker, nprocs=2, start_method="forkserver")
    assert [first[r]["marker"] for r in (0, 1)] == ["first", "first"]
    assert [second[r]["marker"] for r in (0, 1)] == ["second", "second"]
    assert [second[r]["rank"] for r in (0, 1)] == ["0", "1"]
    assert second[0]["sum"] == 2.0
    assert first[0]["numpy"] != first[1]["numpy"]
    assert first[0]["parent"] == second[0]["parent"] != os.getpid()  # one server, reused


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_failing_rank_is_named_within_seconds_and_no_worker_survives(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        launch(_fail_on_rank_one, str(tmp_path), nprocs=2, timeout=120)
    elapsed = time.monotonic() - started
    error = caught.value
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to surface; rank 0 was left waiting"
    assert (error.rank, error.exitcode, error.error) == (1, 1, "ValueError: bad batch 17 on rank 1")
    assert "_fail_on_rank_one" in error.traceback
    assert str(error).startswith("rank 1 failed (exit code 1): ValueError: bad batch 17 on rank 1")
    # Quiet: ddpkit's summary is what the user sees, not torch's logs or rank 0's secondary traceback.
    assert error.__cause__ is None, "torch's error would print its own copy of the traceback"
    assert error.__suppress_context__
    assert capfd.readouterr().err == ""
    (note,) = error.__notes__
    log = Path(note.rpartition(": ")[2])
    text = log.read_text()
    assert "failed (exitcode: 1)" in text, "torch's launcher log"
    assert "rank 1: Traceback" in text, "every failed rank's traceback"
    assert "rank 0: Traceback" in text
    log.unlink()
    pids = [int(path.stem) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "a worker process was left behind"


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_max_restarts_really_restarts_after_a_failure() -> None:
    """torch 2.13's plain restart meets the previous attempt's store keys; ours must not.

    With a shared store the failure is a race (a rank may read a dead peer's address
    before the peer rewrites it), so this checks the cause directly: the restarted
    attempt must not see a key the failed attempt wrote.
    """
    results = launch(_fail_first_attempt, nprocs=2, max_restarts=1, timeout=30)
    assert results == {0: (1, False, 2.0), 1: (1, False, 2.0)}


def test_unpicklable_functions_are_refused_before_any_process_starts() -> None:
    with pytest.raises(TypeError, match="top level of a module"):
        launch(lambda: None, nprocs=2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nprocs": 0}, r"nprocs=0 must be an integer >= 1"),
        ({"nprocs": 2, "nnodes": 0}, r"nnodes=0 must be"),
        ({"nprocs": 2, "max_restarts": -1}, r"max_restarts=-1 must be an integer >= 0"),
        ({"nprocs": 2, "nnodes": 2}, r"nnodes=2 needs rdzv_endpoint='HOST:PORT'"),
        ({"nprocs": 2, "start_method": "thread"}, r"start_method='thread'"),
    ],
)
def test_bad_launch_arguments_are_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch(_report, 0, scale=1, **options)  # type: ignore[arg-type]


def test_bad_hang_timeouts_and_unresolvable_endpoints_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match=r"must be a number of seconds >= 0 \(0 turns it off\), got -5"):
        launch(_report, 0, scale=1, nprocs=2, timeout=-5)
    with pytest.raises(RendezvousFailedError, match=r"'nohost.invalid' \(the host of rdzv_endpoint="
                       r"'nohost.invalid:29400'\) does not resolve"):  # fmt: skip
        launch(_report, 0, scale=1, nprocs=1, nnodes=2, rdzv_endpoint="nohost.invalid:29400")


def test_a_script_without_a_main_guard_gets_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a spawned worker sees when it re-imports a script that calls launch() at top level."""
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r'if __name__ == "__main__":'):
        launch(_report, 0, nprocs=2, scale=1)


def test_threads_are_shared_among_the_processes_of_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    before = torch.get_num_threads()
    try:
        assert limit_threads(4) == 2
        assert limit_threads(3) == 2
        assert limit_threads(16) == 1, "never fewer than one thread"
        torch.set_num_threads(3)
        assert limit_threads(None) == 3, "an unknown local world size leaves torch's setting alone"
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        assert limit_threads(1) == 3, "OMP_NUM_THREADS wins: torch already read it"
    finally:
        torch.set_num_threads(before)
