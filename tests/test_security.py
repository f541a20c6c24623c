"""Nothing listens beyond loopback on a single node, and no collective unpickles without consent."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import PortTakenError, all_gather_object, destroy_dist_connection, init_dist_connection, launch
from ddpkit._stores import release_loopback_store, serve_on_loopback
from ddpkit.environments import LocalEnvironment
from ddpkit.jobs._agent_log import agent_log
from ddpkit.testing import run_parallel
from tests.helpers import listening_sockets, refused

# 127.0.0.2 is another address of this machine's loopback interface: a socket bound to every
# interface answers there, one bound to 127.0.0.1 does not. Nothing here leaves the machine.
OTHER_LOCAL_ADDRESS = "127.0.0.2"


def _check_exposure(pids: list[int]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(every listening socket of ``pids``, those that also answer on another local address)."""
    sockets = listening_sockets(pids)
    return sockets, [(address, port) for address, port in sockets if not refused(OTHER_LOCAL_ADDRESS, port)]


def _launch_worker() -> tuple[list[tuple[str, int]], list[tuple[str, int]]] | None:
    pids = all_gather_object(os.getpid())
    dist.barrier()  # every store and gloo connection is up
    result = _check_exposure([os.getppid(), *pids]) if dist.get_rank() == 0 else None
    dist.barrier()
    return result


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_launch_listens_on_loopback_only() -> None:
    """The agent's rendezvous store, rank 0's process-group store and gloo: all on 127.0.0.1."""
    result = launch(_launch_worker, nprocs=2)[0]
    assert result is not None
    sockets, exposed = result
    assert len(sockets) >= 3, f"the rendezvous store, the group's store and gloo: {sockets}"
    assert {address for address, _ in sockets} == {"127.0.0.1"}
    assert exposed == []


_PLAIN_SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")  # plain torch: its store would listen on every interface
open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").close()
time.sleep(300)
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_ddpkit_run_keeps_a_plain_scripts_stores_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_SCRIPT)
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", str(script), str(tmp_path)]
    pids: list[int] = []
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          start_new_session=True) as launcher:  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            pids.extend(int(path.stem) for path in tmp_path.glob("*.pid"))
            assert len(pids) == 2, "the workers did not start"
            sockets, exposed = _check_exposure([launcher.pid, *pids])
        finally:
            for pid in [launcher.pid, *pids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert len(sockets) >= 3, sockets
    assert {address for address, _ in sockets} == {"127.0.0.1"}
    assert exposed == []


def test_a_single_process_group_listens_on_loopback_only() -> None:
    listening_before = listening_sockets([os.getpid()])  # earlier tests' stores may be awaiting collection
    init_dist_connection(LocalEnvironment({}), "gloo")
    try:
        sockets, exposed = _check_exposure([os.getpid()])
        assert sockets, "the group's store listens somewhere"
        assert {address for address, _ in sockets} == {"127.0.0.1"}
        assert exposed == []
    finally:
        destroy_dist_connection()
    assert listening_sockets([os.getpid()]) == listening_before, "the store closes with the group"


def test_a_port_held_by_another_program_is_named_with_the_fix() -> None:
    import socket

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(PortTakenError, match=f"port {port} on 127.0.0.1 is taken by another program"):
            serve_on_loopback("127.0.0.1", port)
        started = time.monotonic()
        with pytest.raises(PortTakenError, match=r"taken by another program \(not a torch.distributed store\)"):
            serve_on_loopback("127.0.0.1", port, if_taken="peer")
        assert time.monotonic() - started < 10, "a silent listener does not hang the probe"


def test_a_port_held_by_a_peer_store_is_shared_when_peers_may_hold_it() -> None:
    peer = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert serve_on_loopback("127.0.0.1", peer.port, if_taken="peer") is None, "a second agent: a client"
    assert serve_on_loopback("127.0.0.1", peer.port, if_taken="torch") is None
    with pytest.raises(PortTakenError, match=f"port {peer.port} on 127.0.0.1 is taken by another program"):
        serve_on_loopback("127.0.0.1", peer.port)
    assert serve_on_loopback("10.1.2.3", 29500) is None, "not loopback: torch's own server, for remote peers"
    port = serve_on_loopback("localhost", 0)
    assert port is not None
    assert serve_on_loopback("127.0.0.1", port) == port, "a second holder within a process"
    release_loopback_store(port)
    assert ("127.0.0.1", port) in listening_sockets([os.getpid()]), "the first holder still needs it"
    release_loopback_store(port)
    gc.collect()
    assert ("127.0.0.1", port) not in listening_sockets([os.getpid()]), "the last holder stops it"


# --- pickles ------------------------------------------------------------------------------------


def _mark(path: str) -> None:
    """What a crafted pickle runs when unpickled: leaves a file named after the rank that ran it."""
    Path(f"{path}.rank{dist.get_rank()}").write_text("code ran here")


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_mark, (self.path,))


def _victim_and_attacker(path: str) -> str:
    """Rank 1 sends a crafted pickle; rank 0 gathers objects the normal way."""
    if dist.get_rank() == 1:
        all_gather_object(_Exploit(path), allow_pickle=True)
        return "sent"
    try:
        all_gather_object({"metrics": [0.5]})
    except Exception as exc:  # the refusal is what this test wants to see
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_a_crafted_pickle_from_another_rank_is_rejected_not_executed(tmp_path: Path) -> None:
    path = str(tmp_path / "pwned")
    victim, attacker = run_parallel(_victim_and_attacker, path)
    assert attacker == "sent"
    assert victim.startswith("UnpicklingError"), victim
    assert "allow_pickle=True" in victim
    assert not Path(f"{path}.rank0").exists(), "the payload ran on the rank that did not allow pickles"


def test_the_launcher_log_is_a_new_private_file_that_a_planted_symlink_cannot_redirect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local user who can write the temp directory plants symlinks at every name the log could have had under
    the old predictable scheme (time and pid): the job writes none of them, only a new file of its own."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("")
    now = time.time()
    for second in range(-2, 5):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now + second))
        (tmp_path / f"ddpkit-launch-{stamp}-{os.getpid()}.log").symlink_to(victim)
    with agent_log(str(tmp_path / "failures")) as log:
        logging.getLogger("torch.distributed.elastic").error("the agent's line")
        log.keep = True
    assert victim.read_text() == "", "nothing went through a planted symlink"
    assert not log.path.is_symlink()
    assert "the agent's line" in log.path.read_text()
    assert log.path.stat().st_mode & 0o777 == 0o600, "only the job's user reads it"
