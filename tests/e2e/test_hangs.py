"""Hangs are reported within seconds of the deadline, naming the rank that did not arrive and where every rank is.

End to end: each test launches 2 workers with a 3 s deadline, makes them hang one way, and checks the named
rank(s), the user's own file:line in the report, the time from the start of the hang to the error (deadline +
at most 10 s), and that no process is left behind.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ddpkit
from ddpkit import HangError, TrainLoop, WorkerFailedError
from ddpkit.examples.demo import build_model
from ddpkit.examples.digits import digits_datasets
from tests.helpers import alive, job_environment

DEADLINE = 3.0
HERE = Path(__file__)
#: This file as the report shows it: relative to the working directory when it lies below it.
SHOWN = os.path.relpath(HERE) if not os.path.relpath(HERE).startswith("..") else str(HERE)


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (in a comment), so that assertions follow edits."""
    for number, text in enumerate(HERE.read_text().splitlines(), start=1):
        if marker in text and "_line(" not in text:
            return number
    raise AssertionError(marker)


def _record(directory: str, what: str) -> None:
    """Leave this process's pid, and the time it reached ``what``, where the test can check them."""
    (Path(directory) / f"{os.getpid()}.pid").write_text(f"{what} {time.time()!r}")


def _started(directory: Path) -> float:
    """When the first rank entered the collective the job hangs in."""
    times = [float(p.read_text().split()[1]) for p in directory.glob("*.pid") if p.read_text().startswith("wait")]
    return min(times)


def _blocked_at(directory: Path) -> float:
    """When the DataLoader worker blocked."""
    return next(float(p.read_text().split()[1]) for p in directory.glob("*.pid") if p.read_text().startswith("worker"))


def _pid_of(directory: Path, what: str) -> int:
    return next(int(p.stem) for p in directory.glob("*.pid") if p.read_text().startswith(what))


def _no_process_left(directory: Path) -> None:
    pids = [int(p.stem) for p in directory.glob("*.pid")]
    assert pids, "the workers recorded their pids"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    assert [pid for pid in pids if alive(pid)] == [], "no process left behind"


def _hang(fn: Any, directory: Path, *args: Any, **kwargs: Any) -> tuple[BaseException, float]:
    """Launch ``fn(directory, *args)`` on 2 ranks with the test deadline; the error and when it came."""
    with pytest.raises(WorkerFailedError) as caught:
        ddpkit.launch(fn, str(directory), *args, nprocs=2, timeout=DEADLINE, **kwargs)
    return caught.value, time.time()


# --- the workers (top level: pickled by reference) ------------------------------------------------------


def _sleep_then_all_reduce(directory: str) -> None:
    if dist.get_rank() == 1:
        _record(directory, "sleep")
        time.sleep(120)  # marker: rank 1 sleeps
    _record(directory, "wait")
    dist.all_reduce(torch.ones(7))  # marker: rank 0 waits


def _mismatched(directory: str) -> None:
    _record(directory, "wait")
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(7))  # marker: all_reduce on rank 0
    else:
        dist.broadcast(torch.zeros(5), src=0)  # marker: broadcast on rank 1


def _spin(directory: str) -> None:
    if dist.get_rank() == 1:
        _record(directory, "spin")
        while True:  # marker: rank 1 spins
            pass
    _record(directory, "wait")
    dist.all_reduce(torch.ones(3))


class _SkippingLoop(TrainLoop):
    def training_step(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:  # marker: training_step
        if dist.get_rank() == 1 and self.global_step == 3:
            return torch.zeros((), requires_grad=True)  # skips the model, so DDP's all-reduce of this step
        return super().training_step(model, batch)


def _skip_one_step(directory: str, sharded: bool) -> None:
    _record(directory, "wait")
    train, _ = digits_datasets()
    model = build_model()
    plugin = ddpkit.FSDPPlugin() if sharded else None
    _SkippingLoop(model, DataLoader(train, batch_size=32, shuffle=True), plugin=plugin, progress=False).fit(1)


class _BlockingDigits(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits, except that rank 1's DataLoader worker blocks for good in its 5th batch."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.images, self.labels = digits_datasets()[0].tensors
        self.calls = 0  # per worker process: each has its own copy

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if os.environ.get("RANK") == "1" and self.calls == 4 * 32 + 1:
            _record(self.directory, "worker")
            time.sleep(600)  # marker: the DataLoader worker blocks
        return self.images[index], self.labels[index]


def _blocked_loader(directory: str) -> None:
    _record(directory, "wait")
    model = build_model()
    loader = DataLoader(_BlockingDigits(directory), batch_size=32, shuffle=True, num_workers=1)
    TrainLoop(model, loader, progress=False).fit(1)  # marker: fit of the TrainLoop


class _SleepyLayer(torch.nn.Module):
    """A layer of a sharded model; rank 1 sleeps in layer 1's third forward."""

    def __init__(self, index: int, directory: str) -> None:
        super().__init__()
        self.index, self.directory, self.calls = index, directory, 0
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 1 and self.index == 1 and self.calls == 3:
            _record(self.directory, "wait")
            time.sleep(120)  # marker: rank 1 sleeps in layer 1
        return torch.relu(self.linear(x))


def _sharded_sleeper(directory: str) -> None:
    _record(directory, "start")
    train, _ = digits_datasets()
    model = torch.nn.Sequential(_SleepyLayer(0, directory), _SleepyLayer(1, directory), torch.nn.Linear(64, 10))
    TrainLoop(model, DataLoader(train, batch_size=32), plugin=ddpkit.FSDPPlugin(), progress=False).fit(1)


def _hang_in_the_first_attempt(directory: str) -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    _record(directory, f"attempt{attempt}")
    if attempt == 0 and dist.get_rank() == 1:
        time.sleep(120)
    total = torch.ones(1)
    dist.all_reduce(total)
    return attempt


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_rank_sleeping_before_a_raw_all_reduce_is_named_with_its_line(tmp_path: Path) -> None:
    error, ended = _hang(_sleep_then_all_reduce, tmp_path)
    assert isinstance(error, HangError)
    assert error.stragglers == [1]
    report = str(error)
    assert report.startswith("ddpkit: the job hung: rank 1 did not arrive at all_reduce #1 (float32 [7])")
    assert f"{SHOWN}:{_line('marker: rank 1 sleeps')} in _sleep_then_all_reduce" in report, report
    assert "rank 0: in all_reduce #1 (float32 [7])" in report
    assert f"{SHOWN}:{_line('marker: rank 0 waits')} in _sleep_then_all_reduce" in report
    assert ended - _started(tmp_path) <= DEADLINE + 10
    assert error.report_path is not None
    assert "===== rank 1 =====" in Path(error.report_path).read_text()
    _no_process_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_rank_that_stops_inside_a_sharded_model_is_named_with_the_unit_the_others_wait_in(tmp_path: Path) -> None:
    """With FSDPPlugin every unit gathers its weights: rank 0 waits in the next unit's all-gather, which the
    report names, while rank 1 is named at its line inside layer 1."""
    error, ended = _hang(_sharded_sleeper, tmp_path)
    assert isinstance(error, HangError)
    assert error.stragglers == [1]
    report = str(error)
    headline = report.splitlines()[0]
    assert headline.startswith("ddpkit: the job hung: rank 1 did not arrive at "), report
    assert "of FSDP unit '2' (forward), in which rank 0 has waited" in headline, report
    assert "rank 1: in no collective (its last: all_gather" in report, report
    assert f"now at {SHOWN}:{_line('marker: rank 1 sleeps in layer 1')} in forward" in report, report
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


@pytest.mark.timeout(120)
def test_ranks_in_different_collectives_are_named_with_their_calls(tmp_path: Path) -> None:
    error, ended = _hang(_mismatched, tmp_path)
    assert isinstance(error, HangError)
    assert (error.stragglers, error.mismatched) == ([], [1])
    report = str(error)
    assert "rank 1 called a different collective as #1 than the others" in report
    assert "rank 0: all_reduce (float32 [7]); rank 1: broadcast (float32 [5])" in report
    assert f"{SHOWN}:{_line('marker: broadcast on rank 1')} in _mismatched" in report
    assert f"{SHOWN}:{_line('marker: all_reduce on rank 0')} in _mismatched" in report
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_rank_spinning_in_python_is_named_with_its_line(tmp_path: Path) -> None:
    error, ended = _hang(_spin, tmp_path)
    assert isinstance(error, HangError)
    assert error.stragglers == [1]
    assert f"rank 1: in no collective; now at {SHOWN}:{_line('marker: rank 1 spins')} in _spin" in str(error)
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_rank_skipping_the_model_in_a_train_loop_step_is_named_at_that_step(sharded: bool, tmp_path: Path) -> None:
    """Better than a hang report: the rank that skips the model (DDP's all-reduce, or a sharded model's all-gathers
    and reduce-scatters) raises at that very step."""
    error, ended = _hang(_skip_one_step, tmp_path, sharded)
    assert not isinstance(error, HangError)
    assert error.rank == 1  # type: ignore[attr-defined]
    assert f"rank 1: training_step ({HERE}:{_line('marker: training_step')}) did not call the model in step 4" in str(
        error
    )
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


@pytest.mark.timeout(120)
def test_a_blocked_dataloader_worker_is_named_with_its_stack(tmp_path: Path) -> None:
    error, ended = _hang(_blocked_loader, tmp_path)
    assert isinstance(error, HangError)
    assert error.stragglers == [1]
    report = str(error)
    line = _line("marker: the DataLoader worker blocks")
    fit = re.escape(f"{SHOWN}:{_line('marker: fit of the TrainLoop')} in _blocked_loader")
    called = r"rank 0: in all_reduce #\d+ \(float32 \[\d+\]\) for [\d.]+ s, called at "
    assert re.search(called + fit, report), "rank 0 is called at the user's fit line, not in ddpkit: " + report
    marked_as_users = [row for row in report.splitlines() if row.lstrip().startswith("> ")]
    assert marked_as_users, report
    assert not [row for row in marked_as_users if "ddpkit/" in row and "ddpkit/examples/" not in row], report
    assert "rank 1: in no collective" in report
    assert f"waiting on its DataLoader worker (pid {_pid_of(tmp_path, 'worker')}), which is at {SHOWN}:{line}" in report
    assert error.report_path is not None
    assert f'File "{HERE}", line {line} in __getitem__' in Path(error.report_path).read_text(), "its full dump"
    # From when the worker blocked (the job hangs from then on), not from the start: the DataLoader worker's own
    # start (Python and torch) precedes it.
    assert ended - _blocked_at(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)  # the DataLoader worker included


@pytest.mark.timeout(120)
def test_a_hang_counts_as_a_failure_and_the_job_restarts(tmp_path: Path) -> None:
    results = ddpkit.launch(_hang_in_the_first_attempt, str(tmp_path), nprocs=2, timeout=DEADLINE, max_restarts=1)
    assert results == {0: 1, 1: 1}, "the second attempt completed"
    attempts = sorted(p.read_text().split()[0] for p in tmp_path.glob("*.pid"))
    assert attempts == ["attempt0", "attempt0", "attempt1", "attempt1"]


_PLAIN_SCRIPT = textwrap.dedent(
    """\
    import os, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # plain torch: no ddpkit in the script
    open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w").write(f"wait {time.time()!r}")
    if dist.get_rank() == 1:
        time.sleep(120)  # marker: the script's rank 1 sleeps
    dist.all_reduce(torch.ones(2))
    """
)


@pytest.mark.timeout(120)
def test_ddpkit_run_reports_a_hang_in_a_plain_torch_script(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_SCRIPT)
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", "--timeout", str(DEADLINE), str(script), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110, start_new_session=True, check=False)
    ended = time.time()
    assert done.returncode == 1
    assert "ddpkit run: ddpkit: the job hung: rank 1 did not arrive at all_reduce #1 (float32 [2])" in done.stderr
    assert f"{script}:8 in <module>: time.sleep(120)" in done.stderr
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


@pytest.mark.timeout(60)
def test_an_unresolvable_master_address_fails_before_any_wait() -> None:
    """srun tasks whose node list does not resolve: the first task fails at once, naming the host and variable."""
    env = {
        **os.environ,
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "nosuchnode[1-2].invalid",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "digits",
    }
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "-m", "ddpkit.examples.demo", "--epochs", "1"],
        capture_output=True, text=True, timeout=50, env=env, start_new_session=True, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 15
    assert (
        "the master address 'nosuchnode1.invalid' (the first host of SLURM_NODELIST='nosuchnode[1-2].invalid') "
        "does not resolve" in done.stderr
    ), done.stderr


@pytest.mark.timeout(120)
def test_srun_style_tasks_print_the_report_and_all_exit(tmp_path: Path) -> None:
    """No launcher to raise it: the report goes to stderr, and every task exits instead of waiting forever."""
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_SCRIPT)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tasks = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpkit", "run", "--timeout", str(DEADLINE), str(script), str(tmp_path)],
            env={
                **os.environ,
                "SLURM_PROCID": str(rank),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(rank),
                "SLURM_NODELIST": "localhost",
                "SLURM_JOB_ID": "4242",
                "MASTER_PORT": str(port),
                "SLURM_JOB_NAME": "plain",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    outcomes = [task.communicate(timeout=100) for task in tasks]
    ended = time.time()
    assert [task.returncode for task in tasks] == [1, 1]
    stderr = "".join(err for _, err in outcomes)
    assert stderr.count("ddpkit: the job hung: rank 1 did not arrive at all_reduce #1 (float32 [2])") == 1
    assert f"{script}:8 in <module>: time.sleep(120)" in stderr
    assert ended - _started(tmp_path) <= DEADLINE + 10
    _no_process_left(tmp_path)


_USER_SCRIPT = """
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import ddpkit
from ddpkit.examples.digits import digits_datasets


class Digits(Dataset):
    def __init__(self):
        self.x, self.y = digits_datasets(seed=0)[0].tensors
        self.reads = 0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        self.reads += 1
        if os.environ.get("RANK") == "1" and self.reads == 100:
            time.sleep(600)  # stuck here
        return self.x[index], self.y[index]


def loop():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    loader = DataLoader(Digits(), batch_size=32, shuffle=True, num_workers=1)
    return ddpkit.TrainLoop(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)


def train():
    loop().fit(1)  # the fit


if __name__ == "__main__":
    print("ddpkit from", ddpkit.__file__)
    try:
        if sys.argv[1] == "launch":
            ddpkit.launch(train, nprocs=2, timeout=float(sys.argv[2]))
        else:
            loop().fit_distributed(1, num_processes=2, timeout=float(sys.argv[2]))
    except ddpkit.HangError as error:
        print(error)
"""


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize("install", ["wheel", "checkout"])
def test_the_report_names_the_users_script_from_a_wheel_through_launch_and_from_fit_distributed(
    install: str, tmp_path: Path
) -> None:
    """A user's script (its own Dataset, stuck in rank 1's DataLoader worker) with ddpkit installed from a wheel
    of the checkout, through ``ddpkit.launch``; and with the checkout's install, through ``fit_distributed``
    (the loop pickled to new processes). Rank 0 is "called at" the script's own line, rank 1's worker is at the
    stuck line, no ddpkit frame is marked as the user's, and ddpkit's files are shown short."""
    script = tmp_path / "user_job.py"
    script.write_text(_USER_SCRIPT)
    env = job_environment()
    if install == "wheel":
        wheels, site = tmp_path / "wheels", tmp_path / "site"
        pip = [sys.executable, "-m", "pip"]
        built = [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(HERE.parents[2])]
        subprocess.run(built, check=True, capture_output=True, timeout=120)
        (wheel,) = wheels.glob("ddpkit-*.whl")
        installed = [*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
        subprocess.run(installed, check=True, capture_output=True, timeout=120)
        env["PYTHONPATH"] = str(site)  # before the checkout's editable install
    how = "launch" if install == "wheel" else "fit_distributed"
    done = subprocess.run([sys.executable, str(script.name), how, "10"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=200, start_new_session=True)  # fmt: skip
    out = done.stdout
    assert (f"ddpkit from {tmp_path / 'site'}" if install == "wheel" else "ddpkit from " + str(HERE.parents[2])) in out
    fit = _user_line("# the fit") if how == "launch" else None
    if fit is not None:
        assert re.search(rf"rank 0: in all_reduce #\d+ \(float32 \[\d+\]\) for [\d.]+ s, called at user_job\.py:{fit} "
                         r"in train", out), out  # fmt: skip
    else:  # the user's call is in the parent process: the workers' stacks hold no frame of the script
        assert re.search(r"rank 0: in all_reduce #\d+ \(float32 \[\d+\]\) for [\d.]+ s\n", out), out
    stuck = _user_line("# stuck here")
    assert f"which is at user_job.py:{stuck} in __getitem__: time.sleep(600)" in out, out
    marked = [line for line in out.splitlines() if line.lstrip().startswith("> ")]
    assert marked, out
    assert all("user_job.py:" in line for line in marked), marked
    assert not re.search(r"^\s+/\S*/ddpkit/", out, re.M), "ddpkit's frames shown with absolute paths"
    assert re.search(r"^\s+ddpkit/training/_loop\.py:\d+ in fit", out, re.M), out


def _user_line(marker: str) -> int:
    """The line of the user's script that holds ``marker``."""
    return next(number for number, text in enumerate(_USER_SCRIPT.splitlines(), start=1) if marker in text)
