"""Sharded training (``FSDPPlugin``) as users start it: a script of their own under torchrun, then resumed on
another number of ranks under ``ddpkit run``, against the same script in one process.

Here, the tests that start fresh processes; the others are in tests/ranks/test_fsdp.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import job_environment
from tests.support.guides import shell_blocks

SCRIPT = Path(__file__).parent / "sharded_job.py"
ROOT = Path(__file__).parents[2]


def _run(launcher: list[str], *args: str) -> None:
    env = {**job_environment(), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [*launcher, str(SCRIPT), *args], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    assert result.returncode == 0, f"{launcher} failed:\n{result.stdout}\n{result.stderr}"


@pytest.mark.timeout(600)
def test_a_script_sharded_under_torchrun_resumes_on_three_ranks_under_ddpkit_run_as_one_process_trains(
    tmp_path: Path,
) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run(torchrun, "1", str(tmp_path / "run"), str(tmp_path / "two.pt"))
    # 571 items, 30 a step: 20 steps an epoch, the last of 1 item (one rank's batch; the other runs one that counts
    # nothing); the checkpoint at the epoch's end names its directory
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["last-e1-s20-p0.dcp", "last.pt"]
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert [fractions["inp.weight"] for fractions in two["held"]] == [0.5, 0.5], "24 rows: 12 on each rank"
    assert all(0.4 <= f <= 0.6 for fractions in two["held"] for f in fractions.values()), "half of every weight"

    _run([sys.executable, "-m", "ddpkit", "run", "-n", "3"], "3", str(tmp_path / "run"), str(tmp_path / "three.pt"))
    _run([sys.executable], "3", str(tmp_path / "alone"), str(tmp_path / "one.pt"))
    three, one = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("three", "one"))
    assert max(float((three["weights"][k] - one["weights"][k]).abs().max()) for k in one["weights"]) < 1e-5
    assert three["history"]["train_loss"] == pytest.approx(one["history"]["train_loss"], rel=1e-5)
    assert one["history"]["validation_accuracy"][-1] > 0.5, "it learned (10 classes)"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["last-e3-s60-p0.dcp", "last.pt"]


@pytest.mark.timeout(600)
def test_the_language_model_example_stopped_at_step_30_on_two_ranks_goes_on_on_three_as_one_process_trains(
    tmp_path: Path,
) -> None:
    """docs/sharded.md's commands (a step budget, evaluation and checkpoints by step, activation checkpointing,
    asynchronous checkpoints, a callback that stops the run) in float32 with SGD, where the bound is 1e-5."""
    example, exact = str(ROOT / "examples" / "transformer_lm.py"), ["--precision", "32", "--optimizer", "sgd"]

    def run(*args: str) -> str:
        env = {**job_environment(), "PYTHONPATH": str(ROOT)}
        result = subprocess.run([*args, *exact], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    first, second = (  # the guide's two lines, as written, run from this checkout
        [sys.executable, "-m", *line.replace("examples/", f"{ROOT}/examples/").split()]
        for line in shell_blocks()[("sharded.md", 1)].splitlines()
    )
    stopped = run(*first)
    assert "epoch  2  stopped after step 30 (a callback set should_stop)" in stopped
    assert "step 20 (epoch 1)  validation loss" in stopped, "an evaluation every 20 steps"
    assert sorted(p.name for p in (tmp_path / "runs" / "lm").iterdir()) == ["last-e1-s30-p216.dcp", "last.pt"]
    resumed = run(*second, "--save", "three.pt")
    assert "resuming from runs/lm: epoch 2, 216 entries into it, after 30 of 60 optimizer steps" in resumed
    assert "epoch  3  stopped after step 60 (max_steps=60)" in resumed
    alone = run(sys.executable, example, "--save", "one.pt")
    (last,) = (line for line in alone.splitlines() if line.startswith("stopped after step 60"))
    assert last in resumed.splitlines(), "the same validation loss at step 60, to 4 decimals"
    three, one = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("three", "one"))
    assert max(float((three[k] - one[k]).abs().max()) for k in one) < 1e-5
