"""With a job secret, nobody else joins a job: the rendezvous is signed end to end (its state, bound to the job and
a counter; every key of a round), and every new process group proves its members before a tensor moves.

Here, the tests that start fresh processes; the others are in tests/unit/test_nobody_else_joins.py and
tests/ranks/test_nobody_else_joins.py.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import JOB_SECRET, in_a_namespace, job_environment

# --- every group proves its members --------------------------------------------------------------


_STRANGER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
# A stranger at 127.0.0.2 that knows MASTER_ADDR and MASTER_PORT takes rank 1 of the default group with torch's
# own classes (the store, gloo), then adds its value to an all_reduce.
store = dist.PrefixStore("default_pg/0//cpu/", dist.TCPStore(sys.argv[1], int(sys.argv[2]), 2, is_master=False,
                                                             timeout=timedelta(seconds=60)))
options = dist.ProcessGroupGloo._Options()
options._devices = [dist.ProcessGroupGloo.create_device(hostname=sys.argv[3])]
options._timeout = timedelta(seconds=60)
group = dist.ProcessGroupGloo(store, 1, 2, options)
print("STRANGER took rank 1", flush=True)
value = torch.tensor([1000.0])
try:
    group.allreduce([value]).wait()
    print("STRANGER all_reduce returned", value.item(), flush=True)
except Exception as exc:
    print("STRANGER all_reduce failed:", str(exc).splitlines()[0], flush=True)
"""

_HONEST = """
import os, sys, torch, torch.distributed as dist
from ddpkit import init_dist_connection, GroupProofError
from ddpkit.environments import LocalEnvironment
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])  # DDPKIT_JOB_SECRET: the test's
try:
    init_dist_connection(LocalEnvironment(), "gloo", global_rank=0, world_size=2)
    value = torch.tensor([2.0])
    dist.all_reduce(value)
    print("HONEST all_reduce returned", value.item(), flush=True)
except GroupProofError as exc:
    print("HONEST refused:", exc, flush=True)
    print("HONEST group left:", dist.is_initialized(), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_stranger_that_takes_a_rank_in_the_default_group_is_refused_before_the_first_collective(
    tmp_path: Path,
) -> None:
    """Rank 0 starts the default group with a job secret; a program with torch's own classes that knows MASTER_ADDR
    and MASTER_PORT writes its gloo address (127.0.0.2) under rank 1's key, as it must to take rank 1 or to sit
    between two ranks and relay: rank 0 refuses the address, unsigned, naming rank 1 and the key, before it
    connects to it; no group is left and the stranger's all_reduce never returns a sum."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = job_environment()
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["DDPKIT_PROOF_TIMEOUT"] = "5"
    honest_env = {**env, "DDPKIT_JOB_SECRET": JOB_SECRET}
    scripts = {}
    for name, text in (("honest", _HONEST), ("stranger", _STRANGER)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    processes = {}
    try:
        for name in ("honest", "stranger"):
            argv = [port] if name == "honest" else ["127.0.0.1", port, "127.0.0.2"]
            processes[name] = subprocess.Popen([sys.executable, str(scripts[name]), *argv], stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True,
                                               env=honest_env if name == "honest" else env)  # fmt: skip
        honest_out, _ = processes["honest"].communicate(timeout=100)
        stranger_out, _ = processes["stranger"].communicate(timeout=100)
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
    refused = (r"HONEST refused: the gloo address of rank 1 \(the key '0//cpu//0/1'\) in the group's store \(it "
               r"points to 127\.0\.0\.2:\d+\) was not written by a process that holds the job secret "
               r"\(DDPKIT_JOB_SECRET\)")  # fmt: skip
    assert re.search(refused, honest_out), honest_out
    assert "HONEST group left: False" in honest_out, "the group was torn down"
    assert "HONEST all_reduce returned" not in honest_out
    assert "STRANGER all_reduce returned" not in stranger_out, stranger_out
    if "STRANGER took rank 1" in stranger_out:  # its group formed on its side: its first collective fails
        assert "STRANGER all_reduce failed" in stranger_out, stranger_out
    else:  # its group never formed: rank 0's own address is signed, which torch's gloo cannot read (ValueError,
        # or MemoryError when the signed bytes read as a huge length), or rank 0 never connected to it (RuntimeError)
        failed = r"(ValueError|RuntimeError|MemoryError): "
        assert re.search(r"group = dist\.ProcessGroupGloo\(store, 1, 2, options\)\n(.*\n)*" + failed, stranger_out), (
            stranger_out
        )


# --- a two-node job, and a stranger on its network ------------------------------------------------


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_stranger_that_writes_the_rounds_master_address_never_exchanges_a_tensor_with_a_rank(
    tmp_path: Path,
) -> None:
    """In a namespace of its own, a two-node `ddpkit run` job with a secret; a stranger at 10.77.0.2 keeps writing
    the rounds' MASTER_ADDR/MASTER_PORT (and the assigned ranks) from before the agents start, pointing at its own
    store and gloo group, where it waits as rank 0: the agents refuse the values, naming the key, and stop; the
    stranger never gets a member, let alone a sum."""
    result = in_a_namespace("hijack", tmp_path)
    assert result["stopped"], result
    assert result["seconds"] < 60, result
    assert result["exit_codes"] == [1, 1], result["logs"]
    assert result["sums"] == [], "no worker all-reduced"
    assert result["stranger"] in ({}, {"joined": False}), "nobody joined the stranger's group"
    refused = "was not written by a rendezvous agent of this job and was refused: it is not signed"
    for log in result["logs"]:
        assert "ddpkit run: the value of torch.rendezvous.job1." in log or (
            "another agent of this job stopped the rendezvous" in log
        ), log
        assert refused in log, log


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_a_stranger_that_takes_a_rank_of_a_two_node_job_is_named_and_gets_no_sum(tmp_path: Path) -> None:
    """The same job, whose workers make their group with ddpkit and whose rank 1 comes late; the stranger reads
    the real MASTER_ADDR/MASTER_PORT and writes its gloo address (10.77.0.2) under rank 1's key, with torch's own
    classes: rank 0 refuses that address, unsigned, before connecting to it; the stranger gets no sum (it cannot
    even read rank 0's address, signed), and the job stops."""
    result = in_a_namespace("takeover", tmp_path)
    assert result["stopped"], result
    assert result["exit_codes"] == [1, 1], result["logs"]
    assert "all_reduce" not in result["stranger"], result["stranger"]
    assert result["sums"] == [], "no worker all-reduced"
    refusal = result["refusals"]["refusal-0"]
    assert re.match(r"GroupProofError: the gloo address of rank 1 \(the key '0//cpu//0/1'\) in the group's store "
                    r"\(it points to 10\.77\.0\.2:\d+\) was not written by a process that holds the job secret",
                    refusal), refusal  # fmt: skip
    assert "nothing of the job's data moved" in refusal
    assert "ddpkit run: rank 0 failed" in result["logs"][0] or "GroupProofError" in result["logs"][0]
