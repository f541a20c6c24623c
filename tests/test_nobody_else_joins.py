"""With a job secret, nobody else joins a job: the rendezvous is signed end to end (its state, bound to the job and
a counter; every key of a round), and every new process group proves its members before a tensor moves."""

from __future__ import annotations

import base64
import os
import re
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import GroupProofError
from ddpkit._group_proof import prove_members
from ddpkit._secret import use_job_secret
from ddpkit.jobs import _rendezvous
from ddpkit.testing import run_parallel
from tests.helpers import in_a_namespace, rendezvous_handler, state_holder

SECRET = b"a secret only the job has"
_REFUSED = r"\) was not written by a rendezvous agent of this job and was refused: "


def _store() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _state(store: TCPStore) -> bytes:
    return bytes(store.get("torch.rendezvous.job"))


# --- the rendezvous's keys ----------------------------------------------------------------------


def test_every_key_of_a_round_is_signed_and_one_a_stranger_wrote_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """MASTER_ADDR, MASTER_PORT and the ranks travel through plain keys of the round's store: with a secret each
    value is signed for its job, round and key, and a value a stranger wrote there (plain, or signed for another
    key or round) is refused by the agent that reads it."""
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    info = handler.next_rendezvous()
    round_store = info.store
    round_ = handler._state_holder.state.round
    raw = f"torch.rendezvous.job.{round_}/MASTER_ADDR"
    assert bytes(store.get(raw)).startswith(_rendezvous._SIGNED_VALUE), "what torch's agent wrote is signed"
    assert round_store.get("MASTER_ADDR").decode() == info.bootstrap_store_info.master_addr
    port_key = f"torch.rendezvous.job.{round_}/MASTER_PORT"
    assert int(round_store.get("MASTER_PORT")) == info.bootstrap_store_info.master_port
    signed_addr = bytes(store.get(raw))
    where = rf"the value of torch\.rendezvous\.job\.{round_}/"
    for key, value, why in (
        (raw, b"10.9.9.9", "it is not signed, and this node has a job secret"),
        (port_key, signed_addr, "its signature does not match this node's job secret"),  # another key's
    ):
        store.set(key, value)
        with pytest.raises(_rendezvous.StateRefusedError, match=where + ".*" + why) as caught:
            round_store.get(key.rsplit("/", 1)[1])
        assert "Nothing of it ran" in str(caught.value)
    next_round = _rendezvous.SignedRoundStore(
        dist.PrefixStore(f"torch.rendezvous.job.{round_ + 1}", store),
        handler._state_holder._backend,
        f"torch.rendezvous.job.{round_ + 1}/",
    )
    store.set(f"torch.rendezvous.job.{round_ + 1}/MASTER_ADDR", signed_addr)  # this round's, replayed in the next
    with pytest.raises(_rendezvous.StateRefusedError, match="signature does not match"):
        next_round.get("MASTER_ADDR")
    round_store.multi_set(["torchelastic/assigned_ranks/0"], ["[0, 2, 0, 2]"])
    assert round_store.multi_get(["torchelastic/assigned_ranks/0"]) == [b"[0, 2, 0, 2]"]
    store.set(f"torch.rendezvous.job.{round_}/torchelastic/assigned_ranks/0", "[1, 2, 1, 2]")
    with pytest.raises(_rendezvous.StateRefusedError, match=r"assigned_ranks/0 .*it is not signed"):
        round_store.multi_get(["torchelastic/assigned_ranks/0"])
    handler.shutdown()


def test_without_a_secret_the_rounds_keys_are_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    handler = rendezvous_handler(store, None, monkeypatch)
    info = handler.next_rendezvous()
    assert not isinstance(info.store, _rendezvous.SignedRoundStore)
    assert store.get(f"torch.rendezvous.job.{handler._state_holder.state.round}/MASTER_ADDR").decode() == (
        info.bootstrap_store_info.master_addr
    )
    handler.shutdown()


# --- the rendezvous's state: current, and of this job --------------------------------------------


def test_a_replayed_older_state_of_the_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each signed state carries a counter one above the last one its writer read: an older state written back (a
    replay of what a stranger captured earlier) is refused by every agent that has read a newer one."""
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    handler.next_rendezvous()
    older = _state(store)
    handler.set_closed()  # a newer state
    newer = _state(store)
    assert newer != older
    holder = state_holder(handler)
    holder.sync()
    store.set("torch.rendezvous.job", older)
    with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + "it is an older state of this job, replayed"):
        holder.sync()
    store.set("torch.rendezvous.job", newer)
    holder.sync()  # the current state still passes
    assert holder.state.closed
    handler.shutdown()


def test_a_state_signed_in_an_earlier_job_with_the_same_secret_and_run_id_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every signature binds the job's id, which the store's first agent draws at random: a state of an earlier job
    (same secret, same run id) does not verify in this one."""
    earlier_store = _store()
    earlier = rendezvous_handler(earlier_store, SECRET, monkeypatch)
    earlier.next_rendezvous()
    captured = _state(earlier_store)
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    holder = state_holder(handler)
    assert store.get(_rendezvous.job_key("job")) != earlier_store.get(_rendezvous.job_key("job")), "a new job id"
    store.set("torch.rendezvous.job", captured)
    with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + ".*or it was signed for another job"):
        holder.sync()
    earlier.shutdown()


def test_the_stores_host_refuses_a_job_id_someone_wrote_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    earlier = _store()
    first = _rendezvous.claim_job(earlier, "job", "here", SECRET)
    assert _rendezvous.claim_job(earlier, "job", "here", SECRET) == first, "the others take the host's"
    store = _store()
    store.set(_rendezvous.job_key("job"), earlier.get(_rendezvous.job_key("job")))  # a stranger replays it first
    with pytest.raises(_rendezvous.StateRefusedError, match="someone wrote a job id before this agent"):
        _rendezvous.claim_job(store, "job", "here", SECRET, first=True)
    forged = _store()
    forged.set(_rendezvous.job_key("job"), b"0123456789abcdef")
    with pytest.raises(_rendezvous.StateRefusedError, match=r"the job id .* it is not signed"):
        _rendezvous.claim_job(forged, "job", "here", SECRET)


def test_a_refusal_names_the_secret_file_the_node_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    holder = state_holder(handler)
    use_job_secret(b"the file's secret", "--secret-file /etc/job.key")
    try:
        store.set("torch.rendezvous.job", base64.b64encode(b"not signed"))
        with pytest.raises(_rendezvous.StateRefusedError, match=r"this node.s is from --secret-file /etc/job\.key"):
            holder.sync()
    finally:
        use_job_secret(None)


# --- the default group's store: signed ----------------------------------------------------------


def test_clones_of_the_signed_store_sign_and_outlive_torchs_hold_on_them() -> None:
    """The hang watchdog's own connection is a clone of the default group's store, made by torch's prefix store
    through the signed one (torch holds only the C++ part of a store written in Python, and cannot call its
    methods once the Python object is gone, so every clone is kept alive with its store): it signs what it
    writes, refuses what nobody with the secret wrote, and two ranks' clones meet."""
    import gc

    from ddpkit._group_proof import SignedStore

    base = _store()
    signed = [SignedStore(dist.PrefixStore("default_pg", base), SECRET, "job") for _ in "ab"]  # type: ignore[attr-defined]
    mine, theirs = (dist.PrefixStore("0/", store).clone() for store in signed)  # type: ignore[attr-defined]
    gc.collect()
    mine.set("ddpkit/hang/answer/0", b"state")
    assert theirs.get("ddpkit/hang/answer/0") == b"state"
    assert bytes(base.get("default_pg/0//ddpkit/hang/answer/0")).endswith(b"state"), "not under torch's default_pg"
    base.set("default_pg/0//ddpkit/hang/answer/1", b"a stranger's")
    with pytest.raises(GroupProofError, match=r"the value of the key '0//ddpkit/hang/answer/1' in the group's store"):
        mine.get("ddpkit/hang/answer/1")


# --- every group proves its members --------------------------------------------------------------


def _prove(secrets: list[bytes], contexts: list[str]) -> str:
    """On a new group of every rank, prove with this rank's secret and context; what happened."""
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    try:
        prove_members(group, contexts[rank], secrets[rank], timeout=10)
    except GroupProofError as exc:
        return f"GroupProofError {sorted(exc.members)}: {exc}"
    finally:
        dist.destroy_process_group(group)
    return "proved"


def test_members_that_hold_the_secret_prove_it_and_a_member_with_another_is_named_by_every_rank() -> None:
    assert run_parallel(_prove, [SECRET, SECRET], ["job", "job"]) == ["proved", "proved"]
    results = run_parallel(_prove, [SECRET, b"another"], ["job", "job"])
    assert results[0].startswith("GroupProofError [1]: rank 1 of this process group could not prove"), results
    assert results[1].startswith("GroupProofError [0]: rank 0 of this process group could not prove"), results
    assert "its proof does not match" in results[0]
    assert "before any of the job's data moved through it" in results[0]


def test_a_proof_made_for_another_group_does_not_verify() -> None:
    """The context (the job, the store the members met at) is part of every proof."""
    results = run_parallel(_prove, [SECRET, SECRET], ["job|127.0.0.1:1000", "job|127.0.0.1:2000"])
    assert all(result.startswith("GroupProofError") for result in results), results


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
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], DDPKIT_JOB_SECRET="a secret only the job has")
try:
    init_dist_connection(LocalEnvironment(), "gloo", global_rank=0, world_size=2)
    value = torch.tensor([2.0])
    dist.all_reduce(value)
    print("HONEST all_reduce returned", value.item(), flush=True)
except GroupProofError as exc:
    print("HONEST refused:", exc, flush=True)
    print("HONEST group left:", dist.is_initialized(), flush=True)
"""


@pytest.mark.e2e
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
    env = {key: value for key, value in os.environ.items() if not key.startswith(("DDPKIT_", "MASTER_"))}
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["DDPKIT_PROOF_TIMEOUT"] = "5"
    scripts = {}
    for name, text in (("honest", _HONEST), ("stranger", _STRANGER)):
        scripts[name] = tmp_path / f"{name}.py"
        scripts[name].write_text(text)
    processes = {}
    try:
        for name in ("honest", "stranger"):
            argv = [port] if name == "honest" else ["127.0.0.1", port, "127.0.0.2"]
            processes[name] = subprocess.Popen([sys.executable, str(scripts[name]), *argv], stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
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
    assert "STRANGER all_reduce failed" in stranger_out or "Error" in stranger_out, stranger_out


def _tensor_is_untouched() -> float:
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value)
    return value.item()


def test_the_pools_own_group_still_works_after_the_proofs() -> None:
    assert run_parallel(_tensor_is_untouched) == [1.0, 1.0]


# --- a two-node job, and a stranger on its network ------------------------------------------------


@pytest.mark.e2e
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


@pytest.mark.e2e
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
