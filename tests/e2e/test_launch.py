"""launch(): results by rank, a failing rank named within seconds, restarts, nothing left behind.

Here, the tests that start fresh processes; the others are in tests/unit/test_launch.py.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit import WorkerFailedError, launch
from tests.helpers import alive
from tests.support.launch import _report

# --- run in the workers (top level: pickled by reference) -----------------------------------


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


@pytest.mark.timeout(120)
def test_max_restarts_really_restarts_after_a_failure() -> None:
    """torch 2.13's plain restart meets the previous attempt's store keys; ours must not.

    With a shared store the failure is a race (a rank may read a dead peer's address
    before the peer rewrites it), so this checks the cause directly: the restarted
    attempt must not see a key the failed attempt wrote.
    """
    results = launch(_fail_first_attempt, nprocs=2, max_restarts=1, timeout=30)
    assert results == {0: (1, False, 2.0), 1: (1, False, 2.0)}
