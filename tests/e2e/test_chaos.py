"""The chaos suite: a fault-tolerant TrainLoop under ``ddpkit run --fault-tolerance -n 3`` while a seeded schedule
kills groups (one; one again right after it comes back; two together, up to 0.45 s apart) and stalls one
(SIGSTOP for 4-8 s). Each run must end with status 0, commit no step twice (no two quorums train one step: no
split brain), use every item once per epoch, end with the weights of one process, and no live group may go
more than 10 s without a commit outside its own stall (tests/support/chaos.py).

A few seeds run here; ``tools/chaos.py`` runs many (the soak) and prints the figures in docs/fault-tolerance.md.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import in_a_namespace
from tests.support.chaos import check_chaos, run_chaos, schedule

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

#: The seeds CI runs: between them, every kind of fault on every group, two kills together on each pair.
SEEDS = (1, 2, 3)


def test_the_ci_seeds_cover_every_fault_on_every_group() -> None:
    faults = [fault for seed in SEEDS for fault in schedule(seed, 3, 138)]
    together = {fault.groups for fault in faults if fault.kind == "kill-together"}
    assert {fault.kind for fault in faults} == {"kill", "kill-again", "stop", "kill-together"}
    assert {g for fault in faults for g in fault.groups} == {0, 1, 2}
    assert len(together) == len(SEEDS), f"two groups killed together: {together}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_schedule_of_faults_never_splits_the_job_nor_retrains_a_step(seed: int, tmp_path: Path) -> None:
    run = run_chaos(seed, tmp_path)
    figures = check_chaos(run)
    print(f"seed {seed}: {', '.join(map(str, schedule(seed, 3, 138)))}: {figures}")


@pytest.mark.netns
@pytest.mark.timeout(420)
def test_the_same_across_three_nodes_each_its_own_command_and_checkpoint_directory(tmp_path: Path) -> None:
    """Seed 2's faults on three "nodes" (test addresses of a network namespace, one `ddpkit run --fault-tolerance
    --nnodes 3` each, the first serving the lighthouse and the job's record): the same checks
    (tests/e2e/netns_chaos.py). Two nodes' groups killed together wait for the third's state through the record
    beside the lighthouse, as on one machine."""
    result = in_a_namespace("", tmp_path, module="tests.e2e.netns_chaos", timeout=400)
    assert "failed" not in result, f"{result.get('failed')}\n{result['output']}"
    print(f"three nodes: {'; '.join(result['schedule'])}: {result['figures']}")
