"""One job, whatever the way in: entry point x way of starting x data, each checked for the DDP invariants.

Here, the tests that start fresh processes; the others are in tests/unit/test_one_job.py and
tests/ranks/test_one_job.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from ddpkit.testing import run_parallel
from tests.e2e import one_job
from tests.helpers import descendants, job_environment
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
    """Run the job; each of its cases holds the DDP invariants and ends with the pool's weights of that case.

    A job that does not end within 240 s fails the test with every thread's stack of its processes; once, on a
    Python with CPython's fork deadlock (gh-112275: fixed in 3.11.8 and 3.12.1), a job whose only stuck process is
    a DataLoader worker still inside ``os.fork`` is started again (the deadlock is the interpreter's)."""
    for attempt in (1, 2):
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        job = subprocess.Popen(command, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=_environment(), start_new_session=True)  # fmt: skip
        try:
            output, _ = job.communicate(timeout=240)
            break
        except subprocess.TimeoutExpired:
            output = _stacks_and_kill(job)
            if attempt == 1 and _FORK_DEADLOCK and _stuck_in_fork(output):
                warnings.warn(
                    f"CPython's fork deadlock (gh-112275) in a DataLoader worker; started again:\n{output}",
                    stacklevel=2,
                )
                continue
            pytest.fail(f"the job did not end within 240 s; every thread's stack of its processes:\n{output[-20000:]}")
    assert job.returncode == 0, output
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for results in zip(*ranks, strict=True):
        check_case(list(results), _reference(results[0]["entry"], results[0]["data"], pool))


#: Whether this Python can deadlock a child in ``os.fork`` (CPython gh-112275).
_FORK_DEADLOCK = sys.version_info < (3, 11, 8) or (3, 12) <= sys.version_info < (3, 12, 1)


def _stuck_in_fork(output: str) -> bool:
    """Whether a process's stack (faulthandler's, in ``output``) shows its current thread still inside ``os.fork``
    in multiprocessing's ``Popen._launch``: a forked child that never got to run its own code."""
    return re.search(r"Current thread 0x[0-9a-f]+ \(most recent call first\):\n\s+File \"[^\"]*popen_fork\.py\", "
                     r"line \d+ in _launch\n", output) is not None  # fmt: skip


def _stacks_and_kill(job: subprocess.Popen[str]) -> str:
    """Every thread's stack of the job's script processes (the ranks and their DataLoader workers: one_job.py's
    SIGUSR1, one process at a time), then the job killed; its whole output."""
    for pid in descendants(job.pid):
        with contextlib.suppress(OSError):
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            python = os.path.basename(command[0]).startswith(b"python")
            launcher = command[1:3] == [b"-m", b"ddpkit"] or b"torch.distributed.run" in command  # SIGUSR1 ends it
            if python and not launcher and any(part.endswith(b"one_job.py") for part in command):
                os.kill(pid, signal.SIGUSR1)
                time.sleep(0.5)
    time.sleep(2)
    os.killpg(job.pid, signal.SIGKILL)
    return job.communicate()[0]


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
