"""The ddpkit command: env (in process), argument errors, and ddpkit run on real scripts (e2e).

Here, the tests that start fresh processes; the others are in tests/unit/test_cli.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import alive
from tests.support.cli import ddpkit

# A plain torchrun-style script, as a user would write it: no ddpkit inside.
SCRIPT = textwrap.dedent(
    """\
    import json, os, sys
    import torch
    import torch.distributed as dist

    out = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    with open(os.path.join(out, f"{attempt}-{rank}-{os.getpid()}.json"), "w") as handle:
        json.dump({"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
                   "local_rank": int(os.environ["LOCAL_RANK"]), "sum": total.item(), "argv": sys.argv[2:],
                   "name": __name__}, handle)
    fail = sys.argv[2]
    if fail == "hang":
        import time
        time.sleep(300)
    if fail == "always" and rank == 1:
        raise ValueError(f"corrupt shard on rank {rank}")
    if fail == "first-attempt" and rank == 1 and attempt == 0:
        sys.exit(3)
    dist.barrier()
    dist.destroy_process_group()
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    (tmp_path / "out").mkdir()
    return path


def outputs(directory: Path) -> list[dict[str, object]]:
    return [json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))]


# --- end to end: ddpkit run ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_run_starts_a_plain_torchrun_script_on_two_processes(script: Path) -> None:
    done = ddpkit("run", "-n", "2", str(script), str(script.parent / "out"), "never", "--flag")
    assert done.returncode == 0, done.stderr
    assert sorted((o["rank"], o["world_size"], o["local_rank"]) for o in outputs(script.parent / "out")) == [
        (0, 2, 0),
        (1, 2, 1),
    ]
    for output in outputs(script.parent / "out"):
        assert (output["sum"], output["argv"], output["name"]) == (3.0, ["never", "--flag"], "__main__")


@pytest.mark.timeout(120)
def test_run_names_the_failing_rank_and_leaves_no_process(script: Path) -> None:
    started = time.monotonic()
    done = ddpkit("run", "-n", "2", str(script), str(script.parent / "out"), "always")
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert "ddpkit run: rank 1 failed (exit code 1): ValueError: corrupt shard on rank 1" in done.stderr
    assert "traceback of rank 1:" in done.stderr
    pids = [int(path.stem.split("-")[2]) for path in (script.parent / "out").glob("*.json")]
    assert len(pids) == 2
    assert not [pid for pid in pids if alive(pid)]


@pytest.mark.timeout(120)
def test_run_max_restarts_recovers_a_plain_init_process_group_script(script: Path) -> None:
    """Plain `torchrun --max-restarts 1` fails this on torch 2.13 (stale keys in the shared store)."""
    done = ddpkit("run", "-n", "2", "--max-restarts", "1", str(script), str(script.parent / "out"), "first-attempt")
    assert done.returncode == 0, done.stderr
    attempts = sorted(
        path.name.split("-")[0] + "-" + path.name.split("-")[1] for path in (script.parent / "out").glob("*")
    )
    assert attempts == ["0-0", "0-1", "1-0", "1-1"]


@pytest.mark.timeout(120)
def test_workers_die_when_the_launcher_is_killed(script: Path) -> None:
    """kill -9 of `ddpkit run` (a CI timeout, the OOM killer) must not leave its workers running."""
    out = script.parent / "out"
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", str(script), str(out), "hang"]
    pids: list[int] = []
    with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True) as launcher:  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while len(list(out.glob("*.json"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            pids.extend(int(path.stem.split("-")[2]) for path in out.glob("*.json"))
            assert len(pids) == 2, "the workers did not start"
            assert all(alive(pid) for pid in pids)
            launcher.kill()  # SIGKILL: no chance to clean up
            launcher.wait()
            deadline = time.monotonic() + 10
            while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not [pid for pid in pids if alive(pid)], "workers outlived their launcher"
        finally:  # the workers run in sessions of their own (torch's agent starts them so)
            for pid in [launcher.pid, *pids]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_sigterm_to_ddpkit_run_stops_its_workers_and_says_so_in_one_line(script: Path) -> None:
    """SIGTERM to `ddpkit run` (scancel, a walltime, a container's stop): torch's agent stops the workers; the
    command says so in one line, without torch's traceback, and ends with 128 + 15."""
    out = script.parent / "out"
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", str(script), str(out), "hang"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launcher:  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while len(list(out.glob("*.json"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            pids = [int(path.stem.split("-")[2]) for path in out.glob("*.json")]
            assert len(pids) == 2, "the workers did not start"
            launcher.send_signal(signal.SIGTERM)
            _, stderr = launcher.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr
    assert "ddpkit run: stopped by SIGTERM: the workers were stopped" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert not [pid for pid in pids if alive(pid)], "workers outlived their launcher"
