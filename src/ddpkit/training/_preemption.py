"""Preemption and walltime on SLURM: checkpoint within two steps when the job is told to stop, then requeue.

SLURM warns a job before it ends it: ``#SBATCH --signal=USR1@90`` sends
SIGUSR1 to every task 90 s before the walltime, ``scancel --signal=USR1 JOB``
does so at once, and preemption or ``scancel`` send SIGTERM (then SIGKILL after
``KillWait``). In a SLURM task, a ``TrainLoop`` with a ``checkpoint_dir`` catches
both while it trains: within two optimizer steps every rank learns that one of
them was signalled (one small all-reduce of a CPU tensor per step, waited for a
step later: the step never waits for it, nor for the GPU), the state is saved,
and the ranks stop with :class:`Preempted`. With ``requeue=True`` rank 0 first runs
``scontrol requeue $SLURM_JOB_ID``: SLURM starts the job script again, and the
``TrainLoop`` resumes at the exact batch. Lightning's SLURM auto-requeue does
the same on SIGUSR1 only and saves a checkpoint of its own kind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._failures import StopWithoutRestart
from ddpkit.environments import detect_environment
from ddpkit.process_group import collective_device, get_rank, is_distributed

__all__ = ["Preempted", "PreemptionHandler"]

#: The signals SLURM sends before it ends a job: the requested warning (``--signal``) and the stop itself.
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preempted(StopWithoutRestart):
    """A ``TrainLoop`` stopped because SLURM signalled the job; its checkpoint holds the state.

    A ``SystemExit`` (status 1, no traceback): code after ``fit`` must not run
    as if training had finished. Under ``ddpkit run``'s agent (a fault-tolerant
    job's replica group) the ranks are not started again, whatever restarts are
    left: ``ddpkit run`` ends with status 1. Attributes: ``signal_name``
    (``"SIGUSR1"``, ``"SIGTERM"``), ``step`` (optimizer steps taken) and
    ``requeued``.
    """

    def __init__(self, signal_name: str, step: int, requeued: bool) -> None:
        super().__init__(1)
        self.signal_name, self.step, self.requeued = signal_name, step, requeued

    def __str__(self) -> str:
        return f"{self.signal_name} at step {self.step}" + (", requeued" if self.requeued else "")


class PreemptionHandler:
    """Catches SLURM's stop signals while a ``TrainLoop`` trains (see the module docstring).

    Args:
        requeue: run ``scontrol requeue $SLURM_JOB_ID`` (rank 0) before stopping.
    """

    def __init__(self, requeue: bool = False) -> None:
        self.requeue = requeue
        self.received = 0  # the signal number this process received, 0: none
        self.active = False
        # The group the flags are all-reduced in (None: the default group, whose backend reduces CPU tensors), and
        # the all-reduce of the last step's flag, not waited for yet.
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None

    def __getstate__(self) -> dict[str, Any]:  # a TrainLoop travels to fit_distributed's workers
        return {"requeue": self.requeue, "received": 0, "active": False}

    @contextmanager
    def watching(self, checkpointing: bool, forwarded: bool = False) -> Iterator[None]:
        """Catch the signals meanwhile, in a SLURM task's main thread with checkpoints; else do nothing.
        ``forwarded``: a process that SLURM's signals reach through a command of the job's own, not a task of
        SLURM's (a replica group's rank: one srun task a node runs ``ddpkit run --fault-tolerance --nnodes``,
        which starts the ranks and passes the signals on); it watches inside any SLURM job."""
        env = detect_environment()
        slurm = env.name == "slurm" or (forwarded and bool(os.environ.get("SLURM_JOB_ID")))
        if not checkpointing or not slurm or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._group = _cpu_group()
        saved = {sig: signal.signal(sig, self._receive) for sig in PREEMPTION_SIGNALS}
        self.received, self.active, self._pending = 0, True, None
        try:
            yield
        finally:
            self.active, self._pending = False, None  # every rank issued it; a rank that left never waits on it
            for sig, handler in saved.items():
                signal.signal(sig, handler)

    def _receive(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def agreed_signal(self) -> int:
        """The signal any rank had received when the previous call was made (0: none); every rank calls it at the
        same step. This call's flag is all-reduced in the background (a CPU tensor: nothing waits for the
        device) and its result is the next call's: the step before took long enough for it to arrive, so the
        step does not wait (one process: its own signal, at once)."""
        if not self.active:
            return 0
        if not is_distributed():
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        previous, self._pending = self._pending, (work, flag)
        if previous is None:
            return 0
        previous[0].wait()
        return int(previous[1].tolist()[0])  # a CPU tensor, reduced a step ago: no wait for any device

    def received_flags(self) -> list[float]:
        """Whether this process received SIGUSR1, SIGTERM: two numbers, 1.0 or 0.0 (zeros when not watching). A
        fault-tolerant step averages them over its groups: a non-zero mean is a signal some group received."""
        received = self.received if self.active else 0
        return [float(received == sig) for sig in PREEMPTION_SIGNALS]

    @staticmethod
    def signal_of(flags: Sequence[float]) -> int:
        """The signal that :meth:`received_flags`, averaged (and read as numbers), says some group received (0:
        none)."""
        return next((int(sig) for sig, flag in zip(PREEMPTION_SIGNALS, flags, strict=True) if flag > 0), 0)

    def stop(self, signum: int, step: int, checkpoint: str, *, leader: bool | None = None) -> None:
        """Requeue (the leader, if asked), say so, and raise :class:`Preempted` (every rank).

        Args:
            leader: whether this process says it and requeues (default: rank 0; a fault-tolerant job's
                group that wrote the checkpoint).

        Raises:
            Preempted: always.
            subprocess.CalledProcessError: ``scontrol requeue`` failed (the leader).
        """
        name = signal.Signals(signum).name
        if get_rank() == 0 if leader is None else leader:
            job = _job_id()
            then = f"requeueing job {job}: it resumes from there" if self.requeue else "requeue=False: the job stops"
            # Said first: the requeue cancels this step at once, and srun may forward nothing written after it.
            print(
                f"ddpkit: {name} at step {step}: checkpoint saved in {checkpoint}; {then}", file=sys.stderr, flush=True
            )
            if self.requeue:
                subprocess.run(["scontrol", "requeue", job], check=True, capture_output=True, text=True)
        raise Preempted(name, step, self.requeue)


_cpu_groups: list[tuple[dist.ProcessGroup | None, dist.ProcessGroup]] = []  # (default group, its gloo twin), once made


def _cpu_group() -> dist.ProcessGroup | None:
    """A group of every rank that all-reduces CPU tensors: the default group when its backend does (gloo), else
    a gloo group made once per default group (every rank calls it: making one is a collective)."""
    if not is_distributed() or collective_device().type == "cpu":
        return None
    world = dist.group.WORLD
    if not _cpu_groups or _cpu_groups[0][0] is not world:
        _cpu_groups[:] = [(world, dist.new_group(backend="gloo"))]
    return _cpu_groups[0][1]


def _job_id() -> str:
    """This job's id for ``scontrol``: ``ARRAYJOB_TASK`` for a task of an array job (as Lightning does)."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID", "")
