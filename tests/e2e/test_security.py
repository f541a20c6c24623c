"""Every server listens on one address, no stranger's pickle runs (collectives, rendezvous), and a job secret
keeps strangers from joining.

Here, the tests that start fresh processes; the others are in tests/unit/test_security.py and
tests/ranks/test_security.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ddpkit import (
    all_gather_object,
    launch,
)
from tests.helpers import in_a_namespace
from tests.support.security import _check_exposure

# 127.0.0.2 is another address of this machine's loopback interface: a socket bound to every
# interface answers there, one bound to 127.0.0.1 does not. Nothing here leaves the machine.


def _launch_worker() -> tuple[list[tuple[str, int]], list[tuple[str, int]]] | None:
    pids = all_gather_object(os.getpid())
    dist.barrier()  # every store and gloo connection is up
    result = _check_exposure([os.getppid(), *pids]) if dist.get_rank() == 0 else None
    dist.barrier()
    return result


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


# --- the rendezvous ----------------------------------------------------------------------------


def _guide_listeners() -> list[str]:
    """The first cells of the Security page's tables of what listens during a job (those headed "| server")."""
    found, listing = [], False
    for line in (Path(__file__).parents[2] / "docs" / "security.md").read_text().splitlines():
        if not line.startswith("|"):
            listing = False
        elif line.startswith("| server"):
            listing = True
        elif listing and not set(line) <= set("|- "):
            found.append(line.split("|")[1].strip())
    return found


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_stranger_on_a_two_node_jobs_network_runs_nothing_and_the_agents_say_why(tmp_path: Path) -> None:
    """In a namespace whose loopback carries 10.77.0.1, the rendezvous host: a two-node `ddpkit run` listens there
    and on loopback only, every listener is one the Security page's table lists, and a pickle written to the rendezvous
    state never runs: both agents stop with the refusal."""
    result = in_a_namespace("attack", tmp_path)
    assert result["started"], result["logs"]
    host, port = result["rendezvous"]
    workers = {int(worker["RANK"]): worker for worker in result["workers"]}
    group_store = (workers[0]["MASTER_ADDR"], int(workers[0]["MASTER_PORT"]))
    assert group_store[0] == host, "rank 0's node advertises its address on the route to the rendezvous host"
    listeners = result["listeners"]
    assert [tuple(s) for s in listeners["agents"][0]] == [(host, port)], "the host's agent: the rendezvous store"
    assert listeners["agents"][1] == [], "the other agent serves nothing"
    roles: dict[str, list[tuple[str, int]]] = {"rendezvous store": [(host, port)], "process-group store": []}
    roles["gloo"] = []
    for sockets in listeners["workers"]:
        for address, number in map(tuple, sockets):
            roles["process-group store" if (address, number) == group_store else "gloo"].append((address, number))
    assert roles["process-group store"] == [group_store], roles
    assert len(roles["gloo"]) >= 2, roles
    every = [address for found in roles.values() for address, _ in found]
    assert set(every) <= {host, "127.0.0.1"}, f"one address per server, never every interface: {roles}"
    named = [role.split(" (")[0].lower() for role in _guide_listeners()]
    assert named[:3] == list(roles), "the Security page's table lists what listens"
    assert result["stopped"], result
    assert result["seconds_to_stop"] < 20, result
    assert not result["marker"], "the stranger's command ran"
    for log, code in zip(result["logs"], result["exit_codes"], strict=True):
        assert code == 1
        assert f"ddpkit run: the rendezvous state in the store at {host}:{port} (key torch.rendezvous.job1)" in log
        assert "it names posix.system, which a rendezvous state never contains. Nothing of it ran." in log


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_two_node_job_over_ipv6_listens_on_the_rendezvous_address_and_loopback_only(tmp_path: Path) -> None:
    result = in_a_namespace("ipv6", tmp_path)
    assert result["started"], result["logs"]
    assert result["exit_codes"] == [0, 0], result["logs"]
    host, port = result["rendezvous"]
    assert [tuple(s) for s in result["listeners"]["agents"][0]] == [(host, port)]
    assert {worker["MASTER_ADDR"] for worker in result["workers"]} == {host}
    found = {address for sockets in result["listeners"]["workers"] for address, _ in sockets}
    assert host in found, "rank 0's process-group store"
    assert found <= {host, "127.0.0.1", "::1"}, found


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_with_a_secret_a_stranger_cannot_add_a_node_to_a_two_node_job(tmp_path: Path) -> None:
    result = in_a_namespace("forged", tmp_path)
    assert result["started"], result["logs"]  # signed states: the job ran
    assert result["participants_before"] == 2
    assert result["stopped"], result
    for log in result["logs"]:
        assert "no job secret" not in log
        assert (
            "was refused: its signature does not match this node's job secret (every node needs the same "
            "DDPKIT_JOB_SECRET), or it was signed for another job. Nothing of it ran." in log
        )
