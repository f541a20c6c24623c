"""Under a real Slurm cluster (two slurmd "nodes" on this machine) and a real Open MPI.

These run when `srun`/`sbatch` (and a controller that answers) or `mpirun` are
there, and skip otherwise; CI brings the cluster up with `tools/slurm-up.sh` and
sets DDPKIT_REQUIRE_SCHEDULERS=1, which turns a skip into a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddpkit._trust.secret import write_secret_file
from tests.helpers import free_port, holds_within, job_environment
from tests.support.guides import ROOT, _guide_job_script, _guide_mpirun_line

DDPKIT = [sys.executable, "-m", "ddpkit"]


def _listens(host: str, port: int) -> bool:
    import socket

    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _run(command: list[str], cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=job_environment())


#: The jobs this module's tests submitted: each test's teardown cancels its own that are still queued or running.
_SUBMITTED: list[str] = []


@pytest.fixture(autouse=True)
def _cancel_what_the_test_submitted() -> Iterator[None]:
    """However the test ends (passed, failed, timed out), none of its jobs stays on the cluster."""
    before = len(_SUBMITTED)
    yield
    for job in _SUBMITTED[before:]:
        subprocess.run(["scancel", job], capture_output=True, timeout=30, env=job_environment())
    del _SUBMITTED[before:]


def _submit(script: str, cwd: Path) -> str:
    """Submit ``script`` (written to ``cwd/job.sh``, its output to ``cwd/job.out``); the job id."""
    path = cwd / "job.sh"
    path.write_text(script)
    submitted = _run(["sbatch", "--parsable", f"--chdir={ROOT}", f"--output={cwd / 'job.out'}", str(path)], cwd)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    _SUBMITTED.append(job)
    return job


def _wait(job: str, cwd: Path, timeout: float = 150) -> tuple[str, str]:
    """Wait until ``job`` has left the queue; ``scontrol show job``'s text and the job's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _run(["squeue", "-h", "-j", job, "-o", "%T"], cwd).stdout.strip():
        time.sleep(0.5)
    return _run(["scontrol", "show", "job", job], cwd).stdout, (cwd / "job.out").read_text()


# --- Slurm ----------------------------------------------------------------------------------------


def _warn_and_start_again(job: str, cwd: Path, deadline: float) -> None:
    """`scancel --signal=USR1 JOB` (SLURM's warning before the walltime), then, once the job has requeued
    itself, start it again at once."""
    assert _run(["scancel", "--signal=USR1", job], cwd).returncode == 0
    # SLURM holds a requeued job for 120 s (its BeginTime) before it may start again: start it sooner, but
    # not within the second of the requeue, whose job credential slurmd has revoked (whole seconds).
    pending = re.compile(r"JobState=PENDING.*Restarts=1", re.S)
    while time.monotonic() < deadline and not pending.search(_run(["scontrol", "show", "job", job], cwd).stdout):
        time.sleep(0.2)
    time.sleep(2)
    _run(["scontrol", "update", f"JobId={job}", "StartTime=now"], cwd)


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_the_clusters_guides_job_script_trains_on_two_nodes(tmp_path: Path) -> None:
    script = _guide_job_script()
    assert "--ntasks-per-node=4" in script, "adapted below to this 2-core test cluster"
    script = script.replace("--ntasks-per-node=4", "--ntasks-per-node=1")
    script = "\n".join(line for line in script.splitlines() if "--gpus-per-node" not in line) + "\n"
    shown, output = _wait(_submit(script, tmp_path), tmp_path)
    assert "JobState=COMPLETED" in shown, shown + output
    assert re.search(r"^2 ranks, 10 epochs: validation accuracy 0\.9\d+$", output, re.M), output


def _fault_tolerance_guides_job(
    out: Path, restarts: str, *lines: str, kill_at: int = 0, checkpoints: Path | None = None
) -> str:
    """The fault-tolerance guide's sbatch script for this 2-core cluster: one rank a node, the lighthouse on
    127.0.0.1 (the node names resolve there, where a lighthouse for other machines refuses to listen), its own
    secret, tests/e2e/ft_trainloop.py (OUT ``out``, KILL_AT ``kill_at``, checkpoints in ``checkpoints``) as the
    script, ``restarts`` in place of ``--max-restarts 3``, and ``lines`` after the ``#SBATCH`` lines (more
    ``#SBATCH`` lines first: sbatch reads none after a command)."""
    script = _guide_job_script("fault-tolerance.md")
    secret = out / "secret"
    write_secret_file(str(secret))
    trainloop = f"-m tests.e2e.ft_trainloop - - {out} {kill_at} 0.35" + (f" {checkpoints}" if checkpoints else "")
    changes = {
        'HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': "HOST=127.0.0.1",
        "-n 4": "-n 1",
        "--max-restarts 3": restarts,
        "~/.ddpkit-secret": str(secret),
        "examples/fault_tolerant.py": trainloop,
        "29510": str(free_port()),  # the guide's port (each place), which an earlier job's lighthouse may hold
        "#SBATCH --gpus-per-node=4\n": "".join(f"{line}\n" for line in [*lines, "export OMP_NUM_THREADS=1"]),
    }  # fmt: skip
    for old, new in changes.items():
        assert old in script, old
        script = script.replace(old, new)
    return script


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_the_fault_tolerance_guides_job_script_loses_a_node_and_the_other_finishes_the_run(tmp_path: Path) -> None:
    """The fault-tolerance guide's sbatch script on the two-node cluster, one rank a node: the lighthouse on the
    batch host, one `ddpkit run --fault-tolerance --nnodes 2` task a node (each node one replica group, named by
    its Slurm node). node002's group SIGKILLs itself in step 30 and is not restarted: node001 commits its next
    step within seconds and finishes the run alone; every item once per epoch, the weights of one process."""
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

    script = _fault_tolerance_guides_job(tmp_path, "--max-restarts 0", "export FT_KILL_GROUP=node002 RUST_LOG=warn",
                                         kill_at=30)  # fmt: skip
    shown, output = _wait(_submit(script, tmp_path), tmp_path, timeout=260)
    assert "rank 0 failed (exit code -9): killed by signal SIGKILL" in output, shown + output[-3000:]
    assert "served by another process" in output, "the script's lighthouse serves the job"
    _check_one_node_finished_alone(output, tmp_path, "node001", "node002")


@pytest.mark.slurm
@pytest.mark.timeout(150)
def test_the_fault_tolerance_guides_job_script_ends_within_a_minute_when_its_lighthouse_does_not_start(
    tmp_path: Path,
) -> None:
    """The guide's sbatch script with a lighthouse command that fails (a wrong path): the script's wait for the
    lighthouse stops when that command has ended, and the job fails with a line that says so, long before its
    walltime (it once waited for a lighthouse that never came until the walltime: 27 minutes in a test)."""
    script = _fault_tolerance_guides_job(tmp_path, "--max-restarts 0")
    assert ".venv/bin/ddpkit lighthouse" in script
    script = script.replace(".venv/bin/ddpkit lighthouse", ".venv/bin/no-such-ddpkit lighthouse")
    started = time.monotonic()
    shown, output = _wait(_submit(script, tmp_path), tmp_path, timeout=120)
    took = time.monotonic() - started
    assert "JobState=FAILED" in shown, shown + output
    assert "ddpkit lighthouse ended before it listened (its error is above)" in output, output
    assert took < 60, f"the job took {took:.0f} s"


def _check_one_node_finished_alone(output: str, out: Path, survivor: str, lost: str) -> None:
    """Node ``lost``'s group (one rank) killed itself in step 30 with no restart left: the job's ``output``
    names it, ``survivor`` committed its next step within NEXT_COMMIT_S without a restart and finished alone;
    every item once per epoch, the weights of one process (step logs in ``out``)."""
    from tests.e2e.ft_trainloop import check_against_one_process, records, steps
    from tests.support.fault_tolerance import NEXT_COMMIT_S

    assert f"replica group '{survivor}' (1 ranks), one of 2" in output, output[-3000:]
    assert f"replica group '{lost}' ended with exit status 1 (no restart left)" in output, output[-3000:]
    assert f"replica group {survivor} at step 31: {lost} left the quorum" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    kept, killed_group = out / survivor, out / lost
    killed = next(r["kill"] for r in records(killed_group) if "kill" in r)
    after = next(r for r in steps([kept]) if r["t"] > killed)["t"] - killed
    print(f"{survivor} committed its next step {after:.2f} s after {lost}'s group was killed")
    assert after < NEXT_COMMIT_S, output[-3000:]
    assert len({r["pid"] for r in steps([kept])}) == 1, f"{survivor} was restarted"
    assert steps([kept])[-1]["groups"] == 1, f"{survivor} finished alone"
    check_against_one_process([kept, killed_group], [kept])


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_slurms_warning_to_a_fault_tolerant_job_checkpoints_requeues_and_it_ends_as_one_process(tmp_path: Path) -> None:
    """The fault-tolerance guide's sbatch script with `--requeue` and a TrainLoop with `requeue=True`:
    `scancel --signal=USR1` (as `#SBATCH --signal=USR1@...` before the walltime) reaches each node's command,
    which hands it through its agent to its ranks; every group stops at one step with a checkpoint, the job is
    requeued and resumes there; every item once per epoch, the weights of one process."""
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")
    from tests.e2e.ft_trainloop import check_against_one_process, steps

    sbatch = ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    script = _fault_tolerance_guides_job(tmp_path, "--max-restarts 1", *sbatch, "export FT_REQUEUE=1 RUST_LOG=warn",
                                         checkpoints=tmp_path / "ckpt")  # fmt: skip
    job = _submit(script, tmp_path)
    outs = [tmp_path / "node001", tmp_path / "node002"]
    deadline = time.monotonic() + 120
    while len(steps(outs[:1])) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    _warn_and_start_again(job, tmp_path, deadline)
    shown, output = _wait(job, tmp_path, timeout=200)
    assert "Restarts=1" in shown, shown + output
    found = re.search(r"ddpkit: SIGUSR1 at step (\d+): checkpoint saved in \S+; requeueing job " + job, output)
    assert found, output[-3000:]
    stop = int(found.group(1))
    pids = {out.name: sorted({r["pid"] for r in steps([out])}) for out in outs}
    assert all(len(p) >= 2 for p in pids.values()), f"each group trained in both runs of the job: {pids}"
    second = [r["step"] for r in steps(outs[:1]) if r["pid"] == pids["node001"][-1]]
    assert second[0] == stop, f"the requeued job resumed after step {stop}, not at {second[0]}"
    check_against_one_process(outs, outs)


@pytest.mark.slurm
@pytest.mark.timeout(180)
def test_srun_on_two_nodes_runs_a_plain_torch_script_and_a_train_loop_in_each_task(tmp_path: Path) -> None:
    script = _run(["srun", "-N", "2", "-n", "2", *DDPKIT, "run", str(ROOT / "examples" / "train.py")], tmp_path)
    assert script.returncode == 0, script.stderr
    assert re.fullmatch(r"2 ranks, 3 epochs: validation accuracy 0\.9\d+\n", script.stdout), script.stdout
    loop = _run(["srun", "-N", "2", "-n", "2", sys.executable, str(ROOT / "examples" / "train_loop.py")], tmp_path)
    assert loop.returncode == 0, loop.stderr
    # TrainLoop.fit_distributed under srun: each task is one rank, nothing spawned; both tasks print the result.
    assert loop.stdout.count("validation accuracy after 5 epochs: 0.9") == 2, loop.stdout
    assert loop.stdout.count("epoch  5/5  train loss") == 1, "rank 0 alone prints its epoch lines"


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_srun_on_two_nodes_trains_a_sharded_model_as_hsdp_and_matches_one_process(tmp_path: Path) -> None:
    """4 tasks on 2 nodes, ``FSDPPlugin(hsdp=True)``: each node's 2 ranks shard the model, the nodes replicate it."""
    example = str(ROOT / "examples" / "sharded.py")
    hybrid = _run(["srun", "-N", "2", "-n", "4", sys.executable, example, "--epochs", "1", "--hsdp"], tmp_path, 200)
    assert hybrid.returncode == 0, hybrid.stderr
    alone = _run([sys.executable, example, "--epochs", "1"], tmp_path)
    line = r"^4 ranks, 1 epochs: validation accuracy (0\.\d+); rank 0 holds (\d+) of (\d+) bytes"
    found = re.search(line, hybrid.stdout, re.M)
    assert found, hybrid.stdout
    assert f"1 rank, 1 epochs: validation accuracy {found[1]};" in alone.stdout, alone.stdout + hybrid.stdout
    assert abs(2 * int(found[2]) - int(found[3])) < 0.01 * int(found[3]), "half of the weights: a node's 2 ranks"


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_doctor_runs_as_a_slurm_job(tmp_path: Path) -> None:
    result = _run(["srun", "-N", "2", "-n", "2", *DDPKIT, "doctor", "--plot", str(tmp_path / "bw.png")], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ddpkit doctor: 2 ranks, backend gloo" in result.stdout
    assert "connectivity: ok" in result.stdout
    assert f"bandwidth plot: {tmp_path / 'bw.png'}" in result.stdout
    assert (tmp_path / "bw.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_failing_rank_under_kill_on_bad_exit_ends_the_job_in_seconds_naming_it(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(
        textwrap.dedent(
            """\
            import time
            import torch.distributed as dist
            dist.init_process_group("gloo")
            if dist.get_rank() == 1:
                raise ValueError("bad batch on rank 1")
            dist.barrier()
            time.sleep(600)
            """
        )
    )
    started = time.monotonic()
    result = _run(["srun", "-N", "2", "-n", "2", "--kill-on-bad-exit=1", *DDPKIT, "run", str(script)], tmp_path)
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    assert "[rank1]: ValueError: bad batch on rank 1" in result.stderr
    # srun names task 1's end: its exit status 1, or, when rank 0's barrier failed on the connection rank 1
    # closed while rank 1 was still tearing down (seen under load), the SIGTERM of --kill-on-bad-exit.
    assert re.search(r"task 1: (Exited with exit code 1|Terminated)", result.stderr), result.stderr


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_node_list_that_does_not_resolve_fails_at_once_naming_the_host(tmp_path: Path) -> None:
    started = time.monotonic()
    result = _run(
        ["srun", "-N", "2", "-n", "2", "env", "SLURM_JOB_NODELIST=nosuchnode[001-002].invalid", *DDPKIT, "run",
         str(ROOT / "examples" / "train.py")],
        tmp_path,
    )  # fmt: skip
    assert time.monotonic() - started < 30
    assert result.returncode != 0
    assert (
        "the master address 'nosuchnode001.invalid' (the first host of "
        "SLURM_JOB_NODELIST='nosuchnode[001-002].invalid') "
        "does not resolve" in result.stderr
    )


_PREEMPTIBLE = textwrap.dedent(
    """\
    import os, sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    import ddpkit
    from ddpkit.examples.digits import digits_datasets

    out = sys.argv[1]

    class Steps(ddpkit.Callback):
        def on_batch_end(self, loop):
            if ddpkit.get_rank() == 0:
                with open(os.path.join(out, "steps.log"), "a") as handle:
                    handle.write(f"{os.environ.get('SLURM_RESTART_COUNT', '0')} {loop.global_step}\\n")
            time.sleep(0.05)

    ddpkit.init_dist_connection()
    train, val = digits_datasets()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    loop = ddpkit.TrainLoop(
        model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        checkpoint_dir=os.path.join(out, "ckpt"), checkpoint_every=5, progress=False, requeue=sys.argv[2] == "1",
    )
    loop.fit(2, callbacks=[Steps()])
    if ddpkit.get_rank() == 0:
        torch.save(model.state_dict(), os.path.join(out, "weights.pt"))
    """
)


def _preemptible_job(out: Path, requeue: bool = True) -> str:
    (out / "train.py").write_text(_PREEMPTIBLE)
    return textwrap.dedent(
        f"""\
        #!/bin/bash
        #SBATCH --nodes=2
        #SBATCH --ntasks-per-node=1
        #SBATCH --requeue
        #SBATCH --open-mode=append
        srun --kill-on-bad-exit=1 {sys.executable} {out / "train.py"} {out} {int(requeue)}
        """
    )


def _steps(out: Path) -> list[tuple[int, int]]:
    path = out / "steps.log"
    return [(int(a), int(s)) for a, s in map(str.split, path.read_text().splitlines())] if path.exists() else []


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_sigusr1_checkpoints_at_the_next_step_requeues_and_the_job_ends_bit_identical(tmp_path: Path) -> None:
    """`scancel --signal=USR1` at step 12 (as `#SBATCH --signal=USR1@...` before the walltime) with requeue=True."""
    plain, signalled = tmp_path / "plain", tmp_path / "signalled"
    plain.mkdir(), signalled.mkdir()
    job = _submit(_preemptible_job(plain), plain)
    shown, output = _wait(job, plain)
    assert "JobState=COMPLETED" in shown, shown + output

    job = _submit(_preemptible_job(signalled), signalled)
    deadline = time.monotonic() + 120
    while len(_steps(signalled)) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    _warn_and_start_again(job, signalled, deadline)
    shown, output = _wait(job, signalled, timeout=120)
    assert "JobState=COMPLETED" in shown, shown + output
    assert "Restarts=1" in shown, "requeued once"

    steps = _steps(signalled)
    first = [step for attempt, step in steps if attempt == 0]
    second = [step for attempt, step in steps if attempt == 1]
    stop = max(first)
    assert f"ddpkit: SIGUSR1 at step {stop}: checkpoint saved in {signalled / 'ckpt'}; requeueing job {job}" in output
    assert second == list(range(stop + 1, 47)), "resumed right after the step that saved, 23 steps per epoch"
    final = torch.load(plain / "weights.pt", weights_only=True)
    for name, tensor in torch.load(signalled / "weights.pt", weights_only=True).items():
        assert torch.equal(tensor, final[name]), f"{name} differs from the uninterrupted job's"


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_scancel_saves_at_the_next_step_and_a_new_submission_resumes_there(tmp_path: Path) -> None:
    """SIGTERM (`scancel`, as preemption sends it) without requeue: the job stops with its state saved;
    submitting it again goes on from the step after the signal and ends as an uninterrupted job."""
    plain, cancelled = tmp_path / "plain", tmp_path / "cancelled"
    plain.mkdir(), cancelled.mkdir()
    shown, output = _wait(_submit(_preemptible_job(plain, requeue=False), plain), plain)
    assert "JobState=COMPLETED" in shown, shown + output

    job = _submit(_preemptible_job(cancelled, requeue=False), cancelled)
    deadline = time.monotonic() + 120
    while len(_steps(cancelled)) < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _run(["scancel", job], cancelled).returncode == 0
    shown, output = _wait(job, cancelled)
    assert "JobState=CANCELLED" in shown, shown
    stop = max(step for _, step in _steps(cancelled))
    assert f"ddpkit: SIGTERM at step {stop}: checkpoint saved in {cancelled / 'ckpt'}; requeue=False" in output
    assert not (cancelled / "weights.pt").exists(), "the code after fit did not run"

    shown, output = _wait(_submit(_preemptible_job(cancelled, requeue=False), cancelled), cancelled)
    assert "JobState=COMPLETED" in shown, shown + output
    assert [step for _, step in _steps(cancelled)] == list(range(1, 47)), "every step once, in order"
    final = torch.load(plain / "weights.pt", weights_only=True)
    for name, tensor in torch.load(cancelled / "weights.pt", weights_only=True).items():
        assert torch.equal(tensor, final[name]), f"{name} differs from the uninterrupted job's"


# --- Open MPI -------------------------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_mpirun_runs_the_demo_and_a_script_under_ddpkit_run(tmp_path: Path) -> None:
    mpirun = ["mpirun", "--oversubscribe", "-n", "2"]
    demo = _run([*mpirun, *DDPKIT, "demo", "--epochs", "2"], tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert re.search(r"^ddpkit demo: 2 processes \(gloo\), 2 epochs, .*validation accuracy 0\.9\d+", demo.stdout, re.M)
    script = _run([*mpirun, *DDPKIT, "run", str(ROOT / "examples" / "train.py"), "--epochs", "2"], tmp_path)
    assert script.returncode == 0, script.stderr
    assert re.fullmatch(r"2 ranks, 2 epochs: validation accuracy 0\.9\d+\n", script.stdout), script.stdout


#: ``ssh [OPTIONS] HOST COMMAND`` as Open MPI's rsh launcher calls it: COMMAND runs on this machine, in a UTS
#: namespace whose host name is HOST. Each "node" gets a daemon of its own, its tasks alone on their node.
_SSH_STAND_IN = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1
shift
exec unshare -u /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
"""


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_the_fault_tolerance_guides_mpirun_line_loses_a_node_and_the_other_finishes_the_run(tmp_path: Path) -> None:
    """The fault-tolerance guide's `mpirun` line on two "nodes" of one rank (ompi-a and ompi-b: Open MPI starts
    each one's daemon through a stand-in for ssh that gives it its own host name, so each task is alone on its
    node): each node one replica group named by its host, the lighthouse served by `ddpkit lighthouse` (so that
    no node's command stays up for it). ompi-b's group SIGKILLs itself in step 30 and is not restarted: its
    command ends with status 1, and with --enable-recovery mpirun keeps ompi-a's task, which commits its next step
    within seconds and finishes the run alone; every item once per epoch, the weights of one process."""
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")
    if subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -u (a UTS namespace, as root) is not possible here")

    ssh = tmp_path / "ssh"
    ssh.write_text(_SSH_STAND_IN)
    ssh.chmod(0o755)
    secret = tmp_path / "secret"
    write_secret_file(str(secret))
    line, port = _guide_mpirun_line(), free_port()
    changes = {
        "node001,node002": "ompi-a,ompi-b",  # no /etc/hosts entries: Open MPI takes them for other machines
        "node001:29510": f"127.0.0.1:{port}",  # both "nodes" share this machine's loopback
        ".venv/bin/ddpkit": f"{sys.executable} -m ddpkit",
        "-n 4": "-n 1",
        "--max-restarts 3": "--max-restarts 0",
        "~/.ddpkit-secret": str(secret),
        "examples/fault_tolerant.py": f"-m tests.e2e.ft_trainloop - - {tmp_path} 30 0.35",
    }
    for old, new in changes.items():
        assert old in line, old
        line = line.replace(old, new)
    env = {**job_environment(), "OMPI_MCA_plm_rsh_agent": str(ssh), "OMPI_MCA_routed": "direct",
           "FT_KILL_GROUP": "ompi-b", "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # tests.e2e.ft_trainloop
    lighthouse = subprocess.Popen([*DDPKIT, "lighthouse", "--host", "127.0.0.1", "--port", str(port)], env=env)
    try:
        assert holds_within(lambda: _listens("127.0.0.1", port), 30), "the lighthouse never listened"
        done = subprocess.run(line.split(), cwd=ROOT, capture_output=True, text=True, timeout=260, env=env)
    finally:
        lighthouse.terminate()
        lighthouse.wait()
    output = done.stdout + done.stderr
    assert output.count("served by another process") == 2, output[-3000:]
    _check_one_node_finished_alone(output, tmp_path, "ompi-a", "ompi-b")
