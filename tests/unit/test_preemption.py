"""SLURM's stop signals while a TrainLoop trains: caught only in SLURM tasks, agreed on by every rank.

Here, the tests that need no process; the others are in tests/ranks/test_preemption.py.
"""

from __future__ import annotations

import os
import signal

import pytest

from ddpkit.environments import detect_environment
from ddpkit.training._preemption import Preempted, PreemptionHandler, _job_id

_SLURM_TASK = {
    "SLURM_JOB_ID": "41",
    "SLURM_JOB_NAME": "digits",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NODELIST": "localhost",
}


def test_outside_a_slurm_task_nothing_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _SLURM_TASK:
        monkeypatch.delenv(name, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    handler = PreemptionHandler()
    with handler.watching(checkpointing=True):
        assert signal.getsignal(signal.SIGTERM) is before
        assert handler.agreed_signal() == 0


def test_a_slurm_task_with_checkpoints_catches_both_signals_and_restores_the_handlers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in _SLURM_TASK.items():
        monkeypatch.setenv(name, value)
    assert detect_environment().name == "slurm"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    handler = PreemptionHandler()
    with handler.watching(checkpointing=False):
        assert signal.getsignal(signal.SIGUSR1) is before[signal.SIGUSR1], "no checkpoint_dir: nothing to save"
    with handler.watching(checkpointing=True):
        os.kill(os.getpid(), signal.SIGTERM)  # caught: the test process goes on
        assert handler.received == signal.SIGTERM
        assert handler.agreed_signal() == signal.SIGTERM  # one process, no group: its own
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_stop_says_what_happened_and_raises_preempted(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(Preempted) as caught:
        PreemptionHandler(requeue=False).stop(int(signal.SIGUSR1), 12, "/shared/ckpt")
    assert (caught.value.code, caught.value.signal_name, caught.value.step) == (1, "SIGUSR1", 12)
    assert capsys.readouterr().err == (
        "ddpkit: SIGUSR1 at step 12: checkpoint saved in /shared/ckpt; requeue=False: the job stops\n"
    )


def test_array_jobs_are_requeued_by_their_task_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "1235")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    assert _job_id() == "1235"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert _job_id() == "1234_2"
