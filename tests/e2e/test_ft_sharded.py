"""Fault-tolerant sharded training: replica groups that each shard the model over their ranks (FSDP2) and average
their gradient shards across the quorum (HSDP across replica groups), started as users start them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.training import TrainState
from tests.e2e.ft_trainloop import EPOCHS, build_loop, check_against_one_process
from tests.support.fault_tolerance import _survivors_wait_for_the_restart, check_group_1_lost_rank_1_and_healed

pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

STEP_DELAY_S = 0.2


@pytest.mark.timeout(420)
def test_sharded_replica_groups_lose_a_rank_heal_from_their_peer_and_end_as_one_process(tmp_path: Path) -> None:
    """`ddpkit run --fault-tolerance -n 4 --group-size 2 --max-restarts 1` with `FSDPPlugin()`: two replica groups
    of two ranks, each rank holding half of every weight. Rank 1 of group-1 SIGKILLs itself inside step 30: group-0
    keeps its processes and commits within NEXT_COMMIT_S; group-1's agent restarts both ranks, which take group-0's
    shards, rank by rank. Every item once per epoch; both groups' whole weights within 1e-5 of one process. The
    writing group's sharded checkpoint then resumes under plain `ddpkit run -n 2` and in one process, each equal
    to one process trained an epoch more."""
    checkpoints = tmp_path / "checkpoints"
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "4", "--group-size", "2",
               "--max-restarts", "1", "-m", "tests.e2e.ft_trainloop", "-", "-", str(tmp_path), "30",
               str(STEP_DELAY_S), str(checkpoints)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_KILL_GROUP": "group-1", "FT_KILL_RANK": "1",
           "FT_PLUGIN": "fsdp", **_survivors_wait_for_the_restart(tmp_path)}  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=270)
    survivors, restarted = check_group_1_lost_rank_1_and_healed(done, tmp_path)
    for group in ("group-0", "group-1"):  # each rank held its half of every weight (the bias of 10: 5 and 5)
        held = [json.loads((tmp_path / f"{group}{suffix}.json").read_text())["held"] for suffix in ("", ".rank1")]
        for name in held[0]:
            assert held[0][name] + held[1][name] == pytest.approx(1.0), (group, name, held)
            assert 0.4 <= held[0][name] <= 0.6, (group, name, held)
    check_against_one_process(survivors + restarted, [survivors[0], restarted[0]])  # rank 0 saved the whole weights
    saved = TrainState.load(checkpoints / "last.pt")
    assert (saved.epoch, saved.global_step) == (EPOCHS, 3 * 23), "the writing group's ranks wrote the last checkpoint"
    assert saved.sharded is not None, "a sharded checkpoint"
    assert (checkpoints / saved.sharded).is_dir()

    reference = build_loop(None)  # one process, an epoch more
    reference.fit(EPOCHS + 1)
    expected = reference.model.state_dict()
    for name, launch in (("two-ranks", ["-m", "ddpkit", "run", "-n", "2", "-m"]), ("one-process", ["-m"])):
        copy = tmp_path / f"resumed-{name}"
        shutil.copytree(checkpoints, copy)
        command = [sys.executable, *launch, "tests.e2e.ft_trainloop", "resume", str(copy / "weights"), str(copy),
                   str(EPOCHS + 1)]  # fmt: skip
        resumed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert f"after {3 * 23} optimizer steps" in resumed.stdout + resumed.stderr, resumed.stderr[-2000:]
        weights = torch.load(copy / "weights.pt")
        off = max(float((weights[k] - expected[k]).abs().max()) for k in expected)
        assert off < 1e-5, f"{name}: {off:.2e} from one process trained {EPOCHS + 1} epochs"


@pytest.mark.timeout(180)
def test_fit_distributed_with_fault_tolerance_and_fsdp_hands_back_one_processs_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loop.fit_distributed(3, num_processes=2)` with `fault_tolerance` and `FSDPPlugin()`: two groups of one
    rank (each shards the model over its one rank). This process gets back plain weights within 1e-5 of one
    process's, every item once per epoch."""
    from ddpkit.fault_tolerance import TorchFT
    from tests.e2e.ft_trainloop import StepLog

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RUST_LOG", "warn")
    loop = build_loop(TorchFT(timeout=10.0, quorum_timeout=30.0), sharded=True)
    loop.out, loop.folder = str(tmp_path), True
    history = loop.fit_distributed(EPOCHS, num_processes=2, callbacks=[StepLog(0.0)])
    weights = loop.model.state_dict()
    assert {type(value) for value in weights.values()} == {torch.Tensor}, "plain tensors, gathered whole"
    torch.save(weights, tmp_path / "fit.pt")
    (tmp_path / "fit.json").write_text(json.dumps(history))
    check_against_one_process([tmp_path / f"group-{i}" for i in range(2)], [tmp_path / "fit"])
