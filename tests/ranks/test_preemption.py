"""SLURM's stop signals while a TrainLoop trains: caught only in SLURM tasks, agreed on by every rank.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_preemption.py.
"""

from __future__ import annotations

import signal

from ddpkit.testing import run_parallel
from ddpkit.training._preemption import PreemptionHandler


def _agree(received: list[int]) -> list[int]:
    import torch.distributed as dist

    handler = PreemptionHandler()
    handler.active = True
    said = [handler.agreed_signal()]  # nothing received before
    handler.received = received[dist.get_rank()]
    said += [handler.agreed_signal(), handler.agreed_signal(), handler.agreed_signal()]
    return said


def test_every_rank_learns_of_a_signal_that_one_rank_received_one_step_later() -> None:
    """The step that sees the signal all-reduces it in the background; the next step acts on it (so that no step
    waits for the reduction), on every rank alike."""
    usr1 = int(signal.SIGUSR1)
    assert run_parallel(_agree, [0, usr1], world_size=2) == [[0, 0, usr1, usr1]] * 2
    assert run_parallel(_agree, [0, 0], world_size=2) == [[0, 0, 0, 0]] * 2
