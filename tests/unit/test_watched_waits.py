"""The quorum's collectives, watched (``_waits.Watched``): torch's timed ``Work.wait`` whose "timed out" leaves the
collective running (gloo's, checked on torch 2.11, 2.13 and 2.15), asked again until it completes, fails, is doomed
or reaches its own timeout. A stand-in for gloo's work here; tests/e2e/test_fault_tolerance.py and test_chaos.py
run the real one (a member stopped with SIGSTOP, a hung group)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from ddpkit.fault_tolerance import _waits
from ddpkit.fault_tolerance._waits import Watched


class _Work:
    """Completes ``after`` seconds from now (with ``error``, if given), as gloo's work: a timed wait that ends
    first raises "Operation timed out!" and changes nothing."""

    def __init__(self, after: float, error: Exception | None = None) -> None:
        self.done_at, self.error = time.monotonic() + after, error
        self.waits: list[float | None] = []

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(None if timeout is None else timeout.total_seconds())
        left = self.done_at - time.monotonic()
        if timeout is not None and left > timeout.total_seconds():
            time.sleep(timeout.total_seconds())
            raise RuntimeError("Operation timed out!")
        time.sleep(max(0.0, left))
        if self.error is not None:
            raise self.error
        return True


@pytest.fixture(autouse=True)
def _watch_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_waits, "WATCH_AFTER_S", 0.2)


def test_a_collective_that_completes_in_time_is_one_wait_as_unwatched() -> None:
    work = _Work(0.05)
    assert Watched(work, lambda: "never asked").wait() is True
    assert work.waits == [0.2]


def test_a_late_collective_is_waited_for_asking_whether_it_is_doomed_and_completes() -> None:
    asked: list[float] = []

    def doomed() -> str | None:
        asked.append(time.monotonic())
        return None

    work = _Work(0.55)
    assert Watched(work, doomed).wait() is True
    assert len(asked) >= 2, "asked every 0.1 s after 0.2 s"
    assert work.waits[0] == 0.2
    assert all(w == 0.1 for w in work.waits[1:-1])


def test_a_doomed_collective_raises_its_reason_instead_of_waiting_on() -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot complete: replica group r1 stopped"):
        Watched(_Work(30.0), lambda: "replica group r1 stopped").wait()
    assert time.monotonic() - began < 2.0


def test_a_failed_collective_raises_its_own_error_not_a_timeout() -> None:
    failed = RuntimeError("Connection closed by peer")  # gloo's errors are RuntimeErrors, as its timeout is
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        Watched(_Work(0.35, failed), lambda: None).wait()


def test_a_collective_past_its_own_timeout_raises_the_timeout() -> None:
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        Watched(_Work(30.0), lambda: None).wait(timedelta(seconds=0.5))
    assert 0.45 < time.monotonic() - began < 2.0
