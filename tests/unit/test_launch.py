"""launch(): results by rank, a failing rank named within seconds, restarts, nothing left behind.

Here, the tests that need no process; the others are in tests/e2e/test_launch.py.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from ddpkit import RendezvousFailedError, launch
from ddpkit.jobs._worker import limit_threads
from tests.support.launch import _report

# --- run in the workers (top level: pickled by reference) -----------------------------------


# --- tests ------------------------------------------------------------------------------------


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
