"""One job, whatever the way in: entry point x way of starting x data, each checked for the DDP invariants.

Here, the tests that start fresh processes; the others are in tests/unit/test_one_job.py and
tests/ranks/test_one_job.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.testing import run_parallel
from tests.e2e import one_job
from tests.helpers import job_environment
from tests.support.one_job import _as_in_the_ddp_tutorial, check_case

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "tests" / "e2e" / "one_job.py"
#: Each case's final weights in the session pool, computed once per session.
_REFERENCE: dict[tuple[str, str], list[float]] = {}


def _reference(entry: str, data: str, tmp_path: Path) -> list[float]:
    """The final weights of the case in the session pool (run there once per session, when first needed)."""
    if (entry, data) not in _REFERENCE:
        results = run_parallel(_as_in_the_ddp_tutorial, entry, data, str(tmp_path), timeout=60)
        _REFERENCE[entry, data] = results[0]["weights"]
    return _REFERENCE[entry, data]


# --- in the session pool: processes that made their group with init_process_group(rank=, world_size=) ---------


@pytest.mark.timeout(180)
def test_fit_distributed_ends_with_the_weights_of_a_fit_in_the_pool(tmp_path: Path) -> None:
    reference = _reference("fit", "map0", tmp_path / "pool")
    loop = one_job.make_loop("map0", str(tmp_path / "ck"))
    loop.fit_distributed(1, num_processes=2)
    torch.testing.assert_close(torch.tensor(one_job.weights(loop.model)), torch.tensor(reference), rtol=0, atol=1e-5)


# --- launchers: one launch each, every case in it ---------------------------------------------------------


def _environment() -> dict[str, str]:
    """:func:`job_environment` with the checkout on ``PYTHONPATH`` (the script imports ``tests.helpers``)."""
    env = job_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _launch_and_check(command: list[str], out: Path, pool: Path) -> None:
    """Run the job; each of its cases holds the DDP invariants and ends with the pool's weights of that case."""
    out.mkdir()
    done = subprocess.run(command, cwd=out, capture_output=True, text=True, timeout=240, env=_environment())
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for results in zip(*ranks, strict=True):
        check_case(list(results), _reference(results[0]["entry"], results[0]["data"], pool))


LAUNCHERS = {
    # (command before the script's arguments, the entry point that must create the group)
    "ddpkit run": ([sys.executable, "-m", "ddpkit", "run", "-n", "2"], "fit"),
    "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], "patch"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_a_launcher_that_sets_only_variables_gets_one_job_from_every_entry_point(launcher: str, tmp_path: Path) -> None:
    prefix, first = LAUNCHERS[launcher]
    out = tmp_path / "job"
    _launch_and_check([*prefix, str(SCRIPT), str(out), first], out, tmp_path / "pool")
    first_case = json.loads((out / "rank0.json").read_text())[0]
    assert (first_case["entry"], first_case["group_before"]) == (first, False), "the entry point made the group"


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_srun_with_two_tasks_gets_one_job_from_every_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "job"
    _launch_and_check(
        ["srun", "-N", "2", "-n", "2", sys.executable, str(SCRIPT), str(out), "fit"], out, tmp_path / "pool"
    )


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_mpirun_with_two_ranks_gets_one_job_from_every_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "job"
    command = ["mpirun", "--oversubscribe", "-n", "2", sys.executable, str(SCRIPT), str(out), "handler"]
    _launch_and_check(command, out, tmp_path / "pool")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("way", ["spawn-tcp", "launch"])
def test_a_group_made_before_the_entry_points_is_used_as_it_is(way: str, tmp_path: Path) -> None:
    out = tmp_path / "job"
    _launch_and_check([sys.executable, str(SCRIPT), str(out), way], out, tmp_path / "pool")
    assert all(case["group_before"] for case in json.loads((out / "rank1.json").read_text()))
