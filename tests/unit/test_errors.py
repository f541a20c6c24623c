"""Errors explain themselves and survive pickling (they cross process boundaries)."""

from __future__ import annotations

import pickle

from ddpkit import ClusterEnvironmentError, CollectiveMismatchError, DDPKitError, WarningDDP, WorkerFailedError


def test_error_hierarchy() -> None:
    for error in (ClusterEnvironmentError, CollectiveMismatchError, WorkerFailedError):
        assert issubclass(error, DDPKitError)
    assert issubclass(DDPKitError, RuntimeError)
    assert issubclass(WarningDDP, UserWarning)


def test_worker_failed_error_names_the_rank_the_error_and_the_others() -> None:
    error = WorkerFailedError(
        2, 1, "ValueError: bad", "Traceback ...\nValueError: bad\n", {2: "ValueError: bad", 0: "RuntimeError: reset"}
    )
    lines = str(error).splitlines()
    assert lines[0] == "rank 2 failed (exit code 1): ValueError: bad"
    assert lines[1] == "then: rank 0: RuntimeError: reset"
    assert lines[2] == "traceback of rank 2:"
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.exitcode, copy.error, copy.failures, str(copy)) == (
        2, 1, "ValueError: bad", error.failures, str(error),
    )  # fmt: skip
    assert WorkerFailedError(0, -9, "killed by signal SIGKILL").failures == {0: "killed by signal SIGKILL"}
