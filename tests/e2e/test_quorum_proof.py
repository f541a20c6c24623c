"""Nobody else joins a fault-tolerant job: every quorum's members prove the job secret before anything moves
between them, a recovering group takes its state without pickle, and a job's groups share one secret.

Here, the tests that start fresh processes; the others are in tests/unit/test_quorum_proof.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import in_a_namespace

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")


# --- the job, as a stranger on its machine meets it ------------------------------------------------------------


@pytest.mark.netns
@pytest.mark.timeout(420)
def test_a_stranger_to_a_fault_tolerant_job_gets_nothing_gives_nothing_runs_nothing_and_can_only_disrupt(
    tmp_path: Path,
) -> None:
    """``ddpkit run --fault-tolerance -n 2 --max-restarts 2`` (a TrainLoop on digits), in a network namespace of
    the test's own. (a) A torchft ``Manager`` of a stranger's joins the quorums: it receives no state, its
    all-reduces never complete, the groups name it; (b) one claims step 10**6 and serves a pickled command: no
    group takes its state, the command never runs; (c) a group with another secret is refused at its start and says why;
    (d) every listener on 127.0.0.1; (e) the lighthouse's kill costs the killed group a restart. The groups'
    weights equal one process's run on the same batches (< 1e-5): no gradient of theirs entered a step."""
    from tests.e2e.ft_trainloop import check_against_one_process

    result = in_a_namespace("", tmp_path, module="tests.e2e.netns_ft_job", timeout=400)
    log = result["log"]
    assert result["code"] == 0, log[-4000:]
    for mode in ("join", "claim"):
        stranger = result[mode]
        print(f"{mode}: {stranger}")
        print(f"{mode}: {stranger['failed_steps_meanwhile']} steps not committed in the groups' logs while the "
              f"stranger took part; both committed again {stranger['went_on_after']:.1f} s after it left")  # fmt: skip
        assert stranger["quorums"] >= 1, f"the {mode} stranger never got into a quorum: {stranger}"
        assert not stranger["received"], f"the {mode} stranger received the run's state"
        assert stranger["all_reduced"] == 0, stranger
        assert stranger["commits"] == 0, stranger
        assert stranger["sent"] == 0, "a group took the claiming stranger's state"
        assert stranger["went_on"], f"the groups did not go on once the {mode} stranger left"
    assert not result["marker"], "the stranger's pickled command ran"
    assert re.search(r"rank 2 \(replica group 'stranger' at 127\.0\.0\.1:\d+\)", log), log[-4000:]
    secret = result["secret"]
    assert secret["refused"], secret
    assert secret["trained"] == 0, "the group with another secret trained in the job"
    assert secret["went_on"], secret
    # Refused at its start, by the job's record beside the lighthouse: it never asks for a quorum.
    why = (r"the job's record at 127\.0\.0\.1:\d+ \(beside the lighthouse\): its answer is not signed with this "
           r"process's job secret: the lighthouse runs with another one")  # fmt: skip
    assert re.search(why, secret["log"]), secret["log"][-3000:]
    assert {address for address, _ in result["listeners"]} == {"127.0.0.1"}, result["listeners"]
    kill = result["kill"]
    print(
        f"kill from the lighthouse's page: the group died {kill['died_after']:.1f} s after the request and "
        f"trained again {kill['back_after']:.1f} s after it (a restart)"
    )
    assert kill["died"], kill
    assert kill["back"], kill
    assert "restart 1 of 2" in log, log[-4000:]
    outs = [tmp_path / "group-0", tmp_path / "group-1"]
    check_against_one_process(outs, outs)


_EXITING = """
import sys, time
from pathlib import Path
from ddpkit.fault_tolerance._waits import reap
out = Path(sys.argv[1])

class Group:  # an aborted quorum group whose end takes a while (gloo's destructor joins its threads)
    def __init__(self, name):
        self.name = name
    def __del__(self):
        time.sleep(0.5)  # the GIL let go, as gloo's destructor does
        (out / self.name).touch()

reap(Group("dropped-as-the-process-exits"), time.monotonic() + 0.2)
reap(Group("due-after-the-exit"), time.monotonic() + 5.0)
time.sleep(0.4)  # the process exits while the first is being dropped
"""


def test_a_group_dropped_as_the_process_exits_is_dropped_first_and_none_is_dropped_after(tmp_path: Path) -> None:
    """The reaper drops a held quorum group in a daemon thread: once the process exits, a group being dropped then
    is dropped before the interpreter goes (a gloo group's destructor that comes back to a finalized interpreter
    aborts the process with SIGABRT) and no later group is dropped at all; the exit waits for neither's time."""
    script = tmp_path / "exiting.py"
    script.write_text(_EXITING)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "dropped-as-the-process-exits").exists(), "the exit cut short the group being dropped"
    assert not (tmp_path / "due-after-the-exit").exists(), "a group was dropped after the process began to exit"
    assert time.monotonic() - started < 4.5, "the exit waited for a held group's time"
