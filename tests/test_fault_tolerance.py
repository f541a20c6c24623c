"""Per-step fault tolerance on torchft: replica groups that lose one and go on in the same processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.errors import RendezvousFailedError
from ddpkit.fault_tolerance import serve_lighthouse
from ddpkit.fault_tolerance._torchft import torchft_module, url_host
from tests.helpers import listening_sockets, refused, wait_for

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

STEPS = 150
KILL_AT = 40


def test_a_missing_torchft_is_named_with_the_install_command() -> None:
    with pytest.raises(ImportError, match=r"pip install 'ddpkit\[ft\]'"):
        torchft_module("torchft_that_does_not_exist")


def test_lighthouse_addresses_are_read_with_ipv6_brackets() -> None:
    assert [url_host(a) for a in ("http://[::1]:29510", "http://127.0.0.1:1/x", "node1:29510")] == [
        "::1", "127.0.0.1", "node1"
    ]  # fmt: skip


def test_a_lighthouse_on_an_address_that_is_not_this_machines_names_the_addresses_it_has() -> None:
    with pytest.raises(RendezvousFailedError, match=r"192\.0\.2\.1.*this machine's addresses are"):
        serve_lighthouse("192.0.2.1")  # TEST-NET-1: never this machine's


def _spawn(replica: str, lighthouse: str, out: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tests.ft_replica", replica, lighthouse, str(STEPS), str(out), "0.05"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    return subprocess.Popen(command, stdout=open(f"{out}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _records(out: Path) -> list[dict[str, Any]]:
    path = Path(f"{out}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_killed_replica_costs_the_others_a_step_not_a_restart_and_comes_back_with_their_weights(
    tmp_path: Path,
) -> None:
    """Three replica groups of one process; SIGKILL one after 40 steps. The other two keep their processes
    and commit their next step within 2 s; the killed one, started again, takes the weights from a peer and
    commits with all three; every server listens on 127.0.0.1 only; all three end with the same weights."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn(f"r{i}", lighthouse.address, out) for i, out in enumerate(outs)]
        wait_for(lambda: sum(r["committed"] for r in _records(outs[2])) >= KILL_AT, "40 steps", processes, timeout=90)
        sockets = listening_sockets([os.getpid(), *(p.pid for p in processes)])
        os.killpg(processes[2].pid, signal.SIGKILL)
        killed = time.time()
        processes[2].wait()
        again = tmp_path / "r2-again"
        processes[2] = _spawn("r2", lighthouse.address, again)
        for process, out in zip(processes, [*outs[:2], again], strict=True):
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
            assert process.returncode == 0, Path(f"{out}.log").read_text()[-3000:]

    assert len(sockets) >= 7, sockets  # the lighthouse; per replica its store, manager server and gloo
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets
    assert all(refused("127.0.0.2", port) for _, port in sockets), "a server answers on every interface"
    for out, process in zip(outs[:2], processes[:2], strict=True):
        records = _records(out)
        assert {r["pid"] for r in records} == {process.pid}, "a survivor was restarted"
        first = next(r for r in records if r["t"] > killed and r["committed"])
        assert first["t"] - killed < 2.0, f"next commit {first['t'] - killed:.2f} s after the kill"
        assert max(r["step"] for r in records) == STEPS
    back = [r for r in _records(again) if r["committed"]]
    assert back[0]["step"] > KILL_AT, "the restarted replica started over instead of healing from a peer"
    assert any(r["participants"] == 3 for r in back), "the restarted replica never joined the quorum"
    weights = [torch.load(f"{out}.pt") for out in (*outs[:2], again)]
    for other in weights[1:]:
        assert max(float((weights[0][k] - other[k]).abs().max()) for k in other) < 1e-6


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_a_stopped_replica_is_dropped_from_the_quorum_and_takes_the_weights_back_when_it_resumes(
    tmp_path: Path,
) -> None:
    """SIGSTOP one of three groups after 30 steps: the other two commit without it within the gloo timeout
    (5 s) and a heartbeat (1 s); after SIGCONT it rejoins, takes the state from a peer and finishes with the
    same weights as the others."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn(f"r{i}", lighthouse.address, out) for i, out in enumerate(outs)]
        wait_for(lambda: sum(r["committed"] for r in _records(outs[2])) >= 30, "30 steps", processes, timeout=90)
        os.killpg(processes[2].pid, signal.SIGSTOP)
        stopped = time.time()

        def without_it() -> bool:
            return any(r["t"] > stopped and r["committed"] and r["participants"] == 2 for r in _records(outs[0]))

        wait_for(without_it, "a step committed by the two others", processes[:2], timeout=30)
        dropped_after = time.time() - stopped
        time.sleep(1.0)
        os.killpg(processes[2].pid, signal.SIGCONT)
        for process, out in zip(processes, outs, strict=True):
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
            assert process.returncode == 0, Path(f"{out}.log").read_text()[-3000:]

    print(f"the two others committed without the stopped group {dropped_after:.1f} s after the stop")
    assert dropped_after < 8.0, f"the others went on {dropped_after:.1f} s after the stop"
    resumed = [r for r in _records(outs[2]) if r["t"] > stopped]
    assert any(r["committed"] and r["participants"] == 3 for r in resumed), "it never rejoined the quorum"
    weights = [torch.load(f"{out}.pt") for out in outs]
    for other in weights[1:]:
        assert max(float((weights[0][k] - other[k]).abs().max()) for k in other) < 1e-6
