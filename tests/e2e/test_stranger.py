"""The job secret holds against a stranger who reaches the job's ports: nothing it writes acts, nothing it reads
discloses, nothing it replays or relays passes. Each test runs the job and the stranger in a network namespace of
their own (tests/e2e/netns_stranger.py); docs/security.md's table of what a stranger can still do lists each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import in_a_namespace


@pytest.mark.netns
@pytest.mark.timeout(180)
@pytest.mark.parametrize("group", ["ddpkit", "plain"], ids=["ensure_dist_connection", "plain init_process_group"])
def test_an_unsigned_hang_trigger_ends_nothing_and_the_ranks_answers_tell_a_stranger_nothing(
    tmp_path: Path, group: str
) -> None:
    """A stranger writes the hang watchdog's trigger for 3 s: both ranks go on. Then a real hang: it is reported,
    naming rank 1, while the stranger reads every answer the ranks leave in the store: sealed, none of it shows
    the host name, a rank's pid or the script."""
    result = in_a_namespace(group, tmp_path, module="tests.e2e.netns_stranger")
    output = result["output"]
    assert result["trigger_key"].endswith("/ddpkit/hang/trigger"), result["keys"]
    assert result["survived"] == ["survived-0", "survived-1"], output
    assert result["exit_code"] == 1, output
    assert re.search(r"rank 1\b.*\n?.*", output), output
    assert "hang" in output.lower(), output
    answers = {key: bytes.fromhex(value) for key, value in result["values"].items() if "/answer/" in key}
    assert answers, f"the stranger saw the ranks' answers: {sorted(result['values'])}"
    for key, value in answers.items():
        told = [result["host"].encode(), b"job.py", b"all_reduce", *(str(pid).encode() for pid in result["pids"])]
        # Sealed bytes hold any 2-byte string by chance (a host named "vm" once): look for 4 bytes or more.
        for secret in [secret for secret in told if len(secret) >= 4]:
            assert secret not in value, f"{key} shows {secret!r}"


def _iptables_or_skip() -> None:
    import os
    import shutil

    if shutil.which("iptables") is None:
        if os.environ.get("DDPKIT_REQUIRE_SCHEDULERS", "0") not in ("", "0"):
            pytest.fail("DDPKIT_REQUIRE_SCHEDULERS is set and iptables is missing (apt-get install iptables)")
        pytest.skip("no iptables (apt-get install iptables): the relay needs its DNAT")


@pytest.mark.netns
@pytest.mark.timeout(200)
def test_a_relay_that_controls_the_network_is_refused_on_both_sides_naming_its_address(tmp_path: Path) -> None:
    """Every connection between the job's processes goes through a relay on 127.0.0.2 (DNAT), the stores'
    included, which changes nothing: the group proof finds it on both ranks, naming 127.0.0.2, before the job's
    all-reduce runs."""
    _iptables_or_skip()
    result = in_a_namespace("relay", tmp_path, module="tests.e2e.netns_stranger")
    output = result["output"]
    assert len(result["relayed"]) >= 3, f"the stores' and gloo's connections went through the relay: {result}"
    assert result["exit_code"] != 0, output
    assert "all_reduce returned" not in output, "a tensor of the job moved through the relay"
    refusal = r"GroupProofError: rank [01] \(at 127\.0\.0\.1:\d+\) of this process group proved that it holds"
    assert re.search(refusal, output), output
    assert re.search(r"came from 127\.0\.0\.2:\d+", output), output


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_a_stranger_speaking_for_a_replica_group_or_relaying_its_quorums_gets_nothing_and_changes_nothing(
    tmp_path: Path,
) -> None:
    """Two replica groups (``ddpkit run --fault-tolerance -n 2 --secret-file``). A stranger that asks the lighthouse
    for quorums in group-0's name with a store of its own gets nothing written to that store (the groups refuse
    it, naming it); a relay on every connection (DNAT) fails every quorum's proof, naming 127.0.0.2, and no step
    commits while it relays. The job goes on after each and ends with one process's weights."""
    from tests.e2e.ft_trainloop import check_against_one_process

    _iptables_or_skip()
    result = in_a_namespace("ft", tmp_path, module="tests.e2e.netns_stranger", timeout=280)
    log = result["log"]
    assert result["code"] == 0, log[-4000:]
    store = result["store"]
    assert store["asked"] >= 1, store
    assert store["keys"] == [], f"a group wrote into the stranger's store: {store['keys']}"
    assert re.search(r"the quorum's store at 127\.0\.0\.2:\d+, which torchft's lighthouse named, is not the store of "
                     r"a replica group of this quorum", log), log[-4000:]  # fmt: skip
    assert store["went_on"] is not None, store
    relay = result["relay"]
    assert relay["relaying_s"] > 3, f"the quorums' connections went through the relay: {relay}"
    assert relay["committed_meanwhile"] == 0, relay
    assert re.search(r"proved that it holds the job secret, but not over a connection of its own: .*127\.0\.0\.2:\d+",
                     log), log[-4000:]  # fmt: skip
    assert relay["went_on"] is not None, relay
    print(f"the groups committed again {store['went_on']:.1f} s after the store's stranger left and "
          f"{relay['went_on']:.1f} s after the relay stopped")  # fmt: skip
    outs = [tmp_path / "group-0", tmp_path / "group-1"]
    check_against_one_process(outs, outs)


@pytest.mark.netns
@pytest.mark.timeout(200)
def test_values_replayed_from_an_earlier_job_with_the_same_secret_and_store_are_refused_naming_their_address(
    tmp_path: Path,
) -> None:
    """Two jobs with the same secret on the same store address (as srun tasks with a fixed MASTER_PORT): a stranger
    writes every value it recorded in job 1's store into job 2's. Job 2's rank 0 refuses them (its group's id is
    new), naming the address a replayed value points to; no all-reduce of job 2 returns."""
    result = in_a_namespace("replay", tmp_path, module="tests.e2e.netns_stranger")
    first, second = result["first"], result["second"]
    assert all("all_reduce returned 4.0" in output for output in first), first
    assert any(key.endswith("ddpkit/group-id/0") for key in result["recorded"]), result["recorded"]
    assert not any("all_reduce returned" in output for output in second), second
    # The stranger answers first when it writes job 1's id of the group before rank 0 draws one; else rank 0 draws
    # one, and job 1's addresses, signed for job 1's group, are refused where they are read.
    replayed_id = (r"rank 0 refused: the group's store at 127\.0\.0\.1:29555 held an id for this group, signed with "
                   r"the job secret \(DDPKIT_JOB_SECRET\), before rank 0 drew one: .*\(a replay\)")  # fmt: skip
    replayed_address = (r"rank [01] refused: the gloo address of rank [01] \(the key '[^']*'\) in the group's store "
                        r"\(it points to 127\.0\.0\.1:\d+\) was not written by a process that holds the job secret "
                        r"\(DDPKIT_JOB_SECRET\) for this group: .*\(a replay\)")  # fmt: skip
    assert re.search(replayed_id, second[0]) or re.search(replayed_address, "".join(second)), second
    assert all(re.search(r"rank [01] refused: ", output) for output in second), second
