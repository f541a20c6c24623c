"""Helpers that tests import: is a process alive, which sockets does it listen on, is a port closed."""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing.context
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit import Callback

__all__ = [
    "SETTLED_FORK",
    "StopAfter",
    "alive",
    "job_environment",
    "listening_sockets",
    "refused",
    "settle_dying_threads",
]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (Linux ``/proc``)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return sorted(found)


def refused(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` is refused."""
    with socket.socket() as probe:
        probe.settimeout(2)
        try:
            probe.connect((address, port))
        except OSError:
            return True
    return False


def settle_dying_threads(limit: float = 2.0, pause: float = 0.02) -> None:
    """Before a fork: wait until no multiprocessing queue feeder thread is left (``limit`` seconds at most),
    then ``pause`` seconds more.

    CPython before 3.11.8 (gh-112275) can deadlock a child forked while another
    thread creates or deletes its thread state. Such threads: a DataLoader
    iterator's queue feeders, which exit a moment after it ends, and gloo's
    threads, which take the GIL for a moment after a collective has returned
    (to release its tensors). A test that forks DataLoader workers right
    after collectives, epoch after epoch, hits it now and then (seen here with
    Python 3.11.7).
    """
    deadline = time.monotonic() + limit
    while any(t.name == "QueueFeederThread" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(pause)


class _SettledForkProcess(multiprocessing.context.ForkProcess):
    def start(self) -> None:
        settle_dying_threads()
        super().start()


class _SettledForkContext(multiprocessing.context.ForkContext):
    Process = _SettledForkProcess


#: A ``fork`` context for DataLoader workers that first lets the last iterator's threads exit (see
#: :func:`settle_dying_threads`).
SETTLED_FORK = _SettledForkContext()


def job_environment() -> dict[str, str]:
    """This shell's environment for a job a test starts (srun, mpirun, torchrun, ...): without what the test
    session set (pytest's, ddpkit's, a process group's), Open MPI allowed to run as root (as CI does)."""
    drop = ("DDPKIT_", "PYTEST_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_", "PMI")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


class StopAfter(Callback):
    """Interrupt training (every rank at the same point), as a crash would."""

    def __init__(self, step: int | None = None, epoch: int | None = None) -> None:
        self.step, self.epoch = step, epoch

    def on_batch_end(self, train_loop: Any) -> None:
        if train_loop.global_step == self.step:
            raise KeyboardInterrupt(f"stopped after step {self.step}")

    def on_epoch_begin(self, train_loop: Any) -> None:
        if train_loop.epoch == self.epoch:
            raise KeyboardInterrupt(f"stopped at the start of epoch {self.epoch}")


def wait_for(condition: Any, what: str, processes: list[subprocess.Popen[bytes]], timeout: float = 120) -> None:
    """Poll ``condition`` until it holds; on a timeout, or when one of ``processes`` failed, kill their process
    groups and fail the test naming ``what`` it waited for."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"waited in vain for {what}")
        time.sleep(0.02)
