"""Helpers that tests import: is a process alive, which sockets does it listen on, is a port closed."""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing.context
import multiprocessing.process
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
    "JOB_SECRET",
    "OTHER_SECRET",
    "SETTLED_FORK",
    "StopAfter",
    "alive",
    "in_a_namespace",
    "job_environment",
    "listening_sockets",
    "no_processes",
    "refused",
    "rendezvous_handler",
    "settle_dying_threads",
    "state_holder",
]

#: A job secret for the tests' jobs: strong enough (256 bits), known to the tests alone.
JOB_SECRET = "5e0d6c1f9a2b47e3b8c4d19f0a6e2b7c3d8f1a4e9b2c6d0f7a3e5b8c1d4f9a2e"
#: Another one, for a process that must not be taken for one of the job's.
OTHER_SECRET = "c7a1f3e9d2b8046a5c9e1f7b3d0a8e6c2f4b9d1a7e3c5f0b8d6a2e4c9f1b7d3a"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (the kernel's pick; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now whose next port is free too (a lighthouse's, whose job record listens on
    port + 1); as racy as :func:`free_port`, but never a pair whose second half another process holds."""
    for _ in range(100):
        port = free_port(host)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free pair of ports on {host} in 100 tries")


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = int(fields[1])
    found, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        found += frontier
    return found


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


def job_environment(*also: str) -> dict[str, str]:
    """This shell's environment for a job a test starts (srun, mpirun, torchrun, ...): without what the test
    session set (pytest's, ddpkit's, a process group's) and the variables beginning with ``also``, Open MPI
    allowed to run as root (as CI does)."""
    drop = ("DDPKIT_", "PYTEST_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_", "PMI", *also)
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


def holds_within(condition: Any, seconds: float) -> bool:
    """Whether ``condition()`` holds within ``seconds`` (polled every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


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


def rendezvous_handler(
    store: Any, secret: bytes | None, monkeypatch: pytest.MonkeyPatch, run_id: str = "job", nodes: int = 1
) -> Any:
    """torch's rendezvous handler for one node, created through torch's registry as the agent creates it."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    from ddpkit.jobs import _rendezvous

    if secret is None:
        monkeypatch.delenv(_rendezvous.SECRET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(_rendezvous.SECRET_VARIABLE, secret.decode())
    _rendezvous.register()
    monkeypatch.setattr(_rendezvous, "PEER_GRACE_S", 0.0)  # no peer agent to wait for
    endpoint = f"127.0.0.1:{store.port}"
    params = RendezvousParameters(
        _rendezvous.BACKEND, endpoint, run_id, nodes, nodes, is_host="false", last_call_timeout=1
    )
    return rendezvous_handler_registry.create_handler(params)


def state_holder(handler: Any) -> Any:
    """torch's holder of the handler's state, syncing with the store at every call (no cache)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _BackendRendezvousStateHolder

    return _BackendRendezvousStateHolder(handler._state_holder._backend, handler._settings, cache_duration=0)


def in_a_namespace(mode: str, out: Path, module: str = "tests.e2e.netns_job", timeout: float = 200) -> dict[str, Any]:
    """Run ``python -m MODULE [MODE] OUT`` (default tests/e2e/netns_job.py) in a network namespace of its own; its
    ``result.json``."""
    import json
    import sys

    subprocess.run(
        ["unshare", "-n", sys.executable, "-m", module, *([mode] if mode else []), str(out)],
        check=True, timeout=timeout, cwd=Path(__file__).parent.parent,
    )  # fmt: skip
    result: dict[str, Any] = json.loads((out / "result.json").read_text())
    return result


def namespace_loopback(*addresses: str) -> None:
    """Inside :func:`in_a_namespace`'s namespace: bring its loopback up, with ``addresses`` (each a ``/32``) on it
    beside 127.0.0.1, the "nodes" and strangers of the script that runs there."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for address in addresses:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)


def no_processes(monkeypatch: pytest.MonkeyPatch, folder: str, pool: bool) -> None:
    """Make starting a process fail in this test, naming what it started and where such a test belongs: a
    subprocess, and a multiprocessing process unless ``pool`` and it is the session pool's worker or a
    DataLoader's."""
    import ddpkit.testing

    def refuse(what: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            where = "tests/e2e (fresh processes)" if pool else "tests/ranks (the session pool) or tests/e2e"
            raise AssertionError(f"a test in {folder} started {what}: move it to {where}")

        return refused

    start = multiprocessing.process.BaseProcess.start

    def start_only_the_pool(process: multiprocessing.process.BaseProcess) -> None:
        target = getattr(getattr(process, "_target", None), "__name__", "")
        if not pool:
            refuse(f"a multiprocessing process ({process.name}, running {target or 'no target'})")()
        if not process.name.startswith("ddpkit-pool-") and target != "_worker_loop":  # a DataLoader's worker
            refuse(f"a multiprocessing process ({process.name}, running {target or 'no target'})")()
        start(process)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_only_the_pool)
    if not pool:
        monkeypatch.setattr(ddpkit.testing._Pool, "run", refuse("a task of the session pool (run_parallel)"))
