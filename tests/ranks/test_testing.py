"""The session pool behind run_parallel: results per rank, errors with their rank, no hangs.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_testing.py.
"""

from __future__ import annotations

import os
import pickle
import time

import pytest
import torch.distributed as dist

from ddpkit import WorkerFailedError, detect_environment
from ddpkit.testing import run_parallel
from tests.support.testing import _placement


def _raise_on(ranks: list[int]) -> int:
    if dist.get_rank() in ranks:
        raise ValueError(f"bad input on rank {dist.get_rank()}")
    return dist.get_rank()


def _sleep_on_rank_one(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _set_variable() -> None:
    os.environ["DDPKIT_TEST_LEAK"] = "1"


def _read_variable() -> str | None:
    return os.environ.get("DDPKIT_TEST_LEAK")


def _unpicklable_result() -> object:
    return lambda: None


def _destroy_group() -> bool:
    dist.destroy_process_group()
    return True


def _environment() -> tuple[str, int, int]:
    env = detect_environment()
    return env.name, env.global_rank(), env.world_size()


class _UnpicklableError(Exception):
    def __init__(self, value: int, extra: str) -> None:
        super().__init__(value)
        self.extra = extra

    def __reduce__(self) -> object:
        raise TypeError("no pickling")


def _raise_unpicklable() -> None:
    raise _UnpicklableError(1, "x")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    expected_sum = float(sum(range(world_size))) * 10
    results = run_parallel(_placement, 100, scale=10, world_size=world_size)
    assert results == [(100 + r, world_size, expected_sum) for r in range(world_size)]


def test_workers_see_a_plain_local_environment_with_their_rank() -> None:
    assert run_parallel(_environment, world_size=3) == [("local", r, 3) for r in range(3)]


def test_exception_of_one_rank_is_reraised_with_its_type_and_every_traceback() -> None:
    with pytest.raises(ValueError, match="bad input on rank 1") as caught:
        run_parallel(_raise_on, [1])
    assert "rank 1:" in str(caught.value.__cause__)
    assert "_raise_on" in str(caught.value.__cause__), "the remote traceback names the failing function"
    assert run_parallel(_placement, 0) == [(0, 2, 1.0), (1, 2, 1.0)], "a fresh pool serves the next test"


def test_errors_on_every_rank_reraise_the_lowest_rank_and_list_all() -> None:
    with pytest.raises(ValueError, match="bad input on rank 0") as caught:
        run_parallel(_raise_on, [0, 1, 2], world_size=3)
    cause = str(caught.value.__cause__)
    assert all(f"bad input on rank {r}" in cause for r in range(3))


def test_a_stuck_rank_raises_timeout_error_and_the_pool_recovers() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) 1 did not finish within 1.0 s.*rank\(s\) 0 finished"):
        run_parallel(_sleep_on_rank_one, 20.0, timeout=1.0)
    assert time.monotonic() - started < 10, "the deadline, not the sleep, must end the call"
    assert run_parallel(_sleep_on_rank_one, 0.0) == [0, 1]


def test_a_dying_worker_is_reported_not_waited_for() -> None:
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match=r"rank 1 .*died \(exit code 3\)"):
        run_parallel(_die_on_rank_one, timeout=25.0)
    assert time.monotonic() - started < 20


def test_unpicklable_result_and_exception_are_reported() -> None:
    with pytest.raises((pickle.PicklingError, AttributeError)):
        run_parallel(_unpicklable_result)
    with pytest.raises(WorkerFailedError, match=r"rank 0 .*_UnpicklableError: 1"):
        run_parallel(_raise_unpicklable)


def test_each_task_starts_with_the_environment_unchanged() -> None:
    run_parallel(_set_variable)
    assert run_parallel(_read_variable) == [None, None]


def test_a_task_that_destroys_the_group_retires_the_pool() -> None:
    assert run_parallel(_destroy_group) == [True, True]
    assert run_parallel(_placement, 0) == [(0, 2, 1.0), (1, 2, 1.0)]
