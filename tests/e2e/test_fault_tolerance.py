"""Per-step fault tolerance on torchft: replica groups that lose one and go on in the same processes.

Here, the tests that start fresh processes; the others are in tests/unit/test_fault_tolerance.py and
tests/ranks/test_fault_tolerance.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.fault_tolerance import TorchFT, serve_lighthouse
from ddpkit.training import TrainState
from tests.e2e.ft_trainloop import (
    check_against_one_process as _check_every_item_once_per_epoch_and_the_weights_of_one_process,
)
from tests.e2e.ft_trainloop import check_callbacks_in_order as _check_callbacks_in_order
from tests.e2e.ft_trainloop import records as _records
from tests.e2e.ft_trainloop import steps as _steps
from tests.helpers import JOB_SECRET, free_port_pair, in_a_namespace, listening_sockets, refused, wait_for
from tests.support.fault_tolerance import (
    NEXT_COMMIT_S,
    _survivors_wait_for_the_restart,
    check_group_1_lost_rank_1_and_healed,
)

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

# The survivors' steps after a kill must outlast a restarted group's start (Python, torch and torchft: 7-9 s on
# the 2-core machine, 20 s and more on a loaded CI machine), else they finish before it is back: 260 steps of
# about 0.08 s; the groups that outlive a kill wait for the restarted one a little after it (FT_WAIT_AT, see
# tests/e2e/ft_replica.py and _survivors_wait_for_the_restart).
STEPS = 300
KILL_AT = 40
STEP_DELAY_S = 0.35


def _spawn(replica: str, lighthouse: str, out: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "tests.e2e.ft_replica", replica, lighthouse, str(STEPS), str(out), "0.05"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", **(env or {})}
    return subprocess.Popen(command, stdout=open(f"{out}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _finish(processes: list[subprocess.Popen[bytes]], outs: list[Path]) -> None:
    """Wait for every process (killing one that takes over 2 minutes); each must have exited 0."""
    for process, out in zip(processes, outs, strict=True):
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        assert process.returncode == 0, Path(f"{out}.log").read_text()[-3000:]


def _stop_until_the_others_go_on_then_resume(
    processes: list[subprocess.Popen[bytes]], outs: list[Path], two_went_on: Any
) -> float:
    """SIGSTOP the third group; once ``two_went_on(stop time)`` holds (within 8 s), SIGCONT it a second later,
    and let all three finish. The time of the stop."""
    os.killpg(processes[2].pid, signal.SIGSTOP)
    stopped = time.time()
    wait_for(lambda: two_went_on(stopped), "a step committed by the two others", processes[:2], timeout=30)
    dropped_after = time.time() - stopped
    time.sleep(1.0)
    os.killpg(processes[2].pid, signal.SIGCONT)
    _finish(processes, outs)
    print(f"the two others committed without the stopped group {dropped_after:.1f} s after the stop")
    assert dropped_after < 8.0, f"the others went on {dropped_after:.1f} s after the stop"
    return stopped


@pytest.mark.timeout(180)
def test_a_killed_replica_costs_the_others_a_step_not_a_restart_and_comes_back_with_their_weights(
    tmp_path: Path,
) -> None:
    """Three replica groups of one process; SIGKILL one after 40 steps. The other two keep their processes
    and commit their next step within NEXT_COMMIT_S (4 s); the killed one, started again, takes the weights
    from a peer and commits with all three; every server listens on 127.0.0.1 only; all three end with the same
    weights."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    marker = str(tmp_path / "restarted")
    waits = {"FT_RESTART_MARKER": marker, "FT_WAIT_FOR": marker, "FT_WAIT_AT": str(KILL_AT + 30)}
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn(f"r{i}", lighthouse.address, out, waits) for i, out in enumerate(outs)]
        wait_for(lambda: sum(r["committed"] for r in _records(outs[2])) >= KILL_AT, "40 steps", processes, timeout=90)
        sockets = listening_sockets([os.getpid(), *(p.pid for p in processes)])
        os.killpg(processes[2].pid, signal.SIGKILL)
        killed = time.time()
        processes[2].wait()
        again = tmp_path / "r2-again"
        processes[2] = _spawn("r2", lighthouse.address, again, {**waits, "FT_RESTARTED": "1"})
        _finish(processes, [*outs[:2], again])

    assert len(sockets) >= 7, sockets  # the lighthouse; per replica its store, manager server and gloo
    assert {address for address, _ in sockets} == {"127.0.0.1"}, sockets
    assert all(refused("127.0.0.2", port) for _, port in sockets), "a server answers on every interface"
    for out, process in zip(outs[:2], processes[:2], strict=True):
        records = _records(out)
        assert {r["pid"] for r in records} == {process.pid}, "a survivor was restarted"
        first = next(r for r in records if r["t"] > killed and r["committed"])
        assert first["t"] - killed < NEXT_COMMIT_S, f"next commit {first['t'] - killed:.2f} s after the kill"
        assert max(r["step"] for r in records) == STEPS
    back = [r for r in _records(again) if r["committed"]]
    assert back[0]["step"] > KILL_AT, "the restarted replica started over instead of healing from a peer"
    assert any(r["participants"] == 3 for r in back), "the restarted replica never joined the quorum"
    weights = [torch.load(f"{out}.pt") for out in (*outs[:2], again)]
    for other in weights[1:]:
        assert max(float((weights[0][k] - other[k]).abs().max()) for k in other) < 1e-6


@pytest.mark.timeout(180)
def test_a_stopped_replica_is_dropped_from_the_quorum_and_takes_the_weights_back_when_it_resumes(
    tmp_path: Path,
) -> None:
    """SIGSTOP one of three groups after 30 steps: the other two commit without it within the gloo timeout
    (5 s) and a heartbeat (1 s); after SIGCONT it rejoins, takes the state from a peer and finishes with the
    same weights as the others."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn(f"r{i}", lighthouse.address, out) for i, out in enumerate(outs)]
        wait_for(lambda: sum(r["committed"] for r in _records(outs[2])) >= 30, "30 steps", processes, timeout=90)
        stopped = _stop_until_the_others_go_on_then_resume(
            processes, outs, lambda since: any(r["t"] > since and r["committed"] and r["participants"] == 2
                                               for r in _records(outs[0])),
        )  # fmt: skip
    resumed = [r for r in _records(outs[2]) if r["t"] > stopped]
    assert any(r["committed"] and r["participants"] == 3 for r in resumed), "it never rejoined the quorum"
    weights = [torch.load(f"{out}.pt") for out in outs]
    for other in weights[1:]:
        assert max(float((weights[0][k] - other[k]).abs().max()) for k in other) < 1e-6


# --- TrainLoop(fault_tolerance=...): the step plan survives a change of quorum ----------------------------


def _finals(outs: list[Path], log: str | None = None) -> list[Path]:
    """The groups of ``outs`` that wrote their final weights. A group that fell out of the quorums (a loaded
    machine) while the others trained the last steps without it ends with status 0 when it asks again, the job
    finished, and writes none: its log (``log``, else its own) must say so."""
    finals = [out for out in outs if Path(f"{out}.pt").exists()]
    for out in outs:
        said = f"replica group {out.name}: the job finished" if log is not None else ": the job finished at step"
        assert out in finals or said in (log or Path(f"{out}.log").read_text()), f"{out.name} wrote no weights"
    assert finals, "no group wrote its weights"
    return finals


def _spawn_loop(
    replica: str, lighthouse: str, out: Path, kill_at: int = 0, delay: float = STEP_DELAY_S, *extra: str,
    env: dict[str, str] | None = None, groups: int = 3,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """One group of a job of ``groups`` (its first step waits for them all) running tests/e2e/ft_trainloop.py."""
    command = [sys.executable, "-m", "tests.e2e.ft_trainloop", replica, lighthouse, str(out), str(kill_at), str(delay),
               *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "DDPKIT_REPLICA_GROUPS": str(groups),
           **(env or {})}  # fmt: skip
    return subprocess.Popen(command, stdout=open(f"{out}.log", "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def _assert_trains_again(out: Path, since: float) -> None:
    """The group logged to ``out`` trained items in a quorum of three after ``since``."""
    back = [r for r in _steps([out]) if r["t"] > since]
    assert any(r["groups"] == 3 and r["items"] for r in back), f"{out.name} never trained in a quorum of 3 again"


@pytest.mark.timeout(240)
def test_a_trainloop_replica_killed_mid_epoch_costs_a_step_and_the_run_ends_as_one_that_lost_nothing(
    tmp_path: Path,
) -> None:
    """Three TrainLoop replica groups (global batch 64); one SIGKILLs itself inside step 30 (the middle of
    epoch 2), 0.5 s into it: the two others are then waiting for it inside the gradients' all-reduce. They
    keep their processes, do that step between them and commit within NEXT_COMMIT_S (4 s) of the kill, as after a kill
    between steps; the killed one, started again, takes the state from a peer and trains again in a quorum
    of three. Every item is in exactly one committed step per epoch, and the weights equal one process's
    (< 1e-5)."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    again = tmp_path / "r2-again"
    waits = _survivors_wait_for_the_restart(tmp_path)
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, 30 if i == 2 else 0,
                                 env={**waits, "FT_KILL_AFTER": "0.5"}) for i, out in enumerate(outs)]  # fmt: skip
        wait_for(lambda: processes[2].poll() is not None, "the replica group to kill itself", processes[:2], 120)
        assert processes[2].returncode == -signal.SIGKILL, Path(f"{outs[2]}.log").read_text()[-3000:]
        killed = next(r["kill"] for r in _records(outs[2]) if "kill" in r)
        processes[2] = _spawn_loop("r2", lighthouse.address, again, env={**waits, "FT_RESTARTED": "1"})
        _finish(processes, [*outs[:2], again])

    for out, process in zip(outs[:2], processes[:2], strict=True):
        records = _steps([out])
        assert {r["pid"] for r in records} == {process.pid}, "a survivor was restarted"
        first = next(r for r in records if r["t"] > killed)
        print(f"{out.name} committed step {first['step']} {first['t'] - killed:.2f} s after the kill")
        assert first["t"] - killed < NEXT_COMMIT_S, f"next commit {first['t'] - killed:.2f} s after the kill"
        assert (first["step"], first["groups"]) == (30, 2), "the lost step was not redone by the two others"
        log = Path(f"{out}.log").read_text()
        # r2 died while it computed its share: in the quorum of step 31 (which then failed: "step 31 was not
        # committed") or not yet, as the lighthouse saw it; either way the two others name it.
        assert "r2 left the quorum" in log, log[-3000:]
    back = _steps([again])
    assert back[0]["step"] > 30, "the restarted group started over instead of taking its peers' state"
    assert any(r["groups"] == 3 and r["items"] for r in back), "the restarted group never trained again"
    # The restarted group began epoch 0, took its peer's state in the middle of a later epoch, and began that one
    # before its first step; every group's callbacks came in order.
    events = _check_callbacks_in_order(again)
    first_step = next(i for i, (name, _) in enumerate(events) if name == "step")
    assert events[first_step - 1] == ("epoch_begin", back[0]["epoch"]), events[:4]
    assert back[0]["epoch"] > 0, "the restarted group's first step was in epoch 0"
    for out in outs[:2]:
        assert [e for e in _check_callbacks_in_order(out) if e[0] != "step"][:2] == [("train_begin", 0),
                                                                                  ("epoch_begin", 0)]  # fmt: skip
    _check_every_item_once_per_epoch_and_the_weights_of_one_process([*outs, again], [*outs[:2], again])


@pytest.mark.timeout(240)
def test_a_hung_trainloop_replica_is_dropped_named_and_rejoins_and_the_run_ends_as_one_that_lost_nothing(
    tmp_path: Path,
) -> None:
    """SIGSTOP one of three TrainLoop replica groups after 20 steps: the two others go on without it (its
    step fails at the collectives' 5 s timeout at most) and their logs name it; after SIGCONT it rejoins and
    takes the state from a peer. Every item is in one committed step per epoch; the weights equal one
    process's (< 1e-5) in all three."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out) for i, out in enumerate(outs)]
        wait_for(lambda: len(_steps([outs[2]])) >= 20, "20 steps", processes, timeout=120)
        stopped = _stop_until_the_others_go_on_then_resume(
            processes, outs, lambda since: any(r["t"] > since and r["groups"] == 2 for r in _steps([outs[0]]))
        )
    for out in outs[:2]:
        assert "r2 left the quorum" in Path(f"{out}.log").read_text(), "the hung group was not named"
    _assert_trains_again(outs[2], stopped)
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(outs, outs)


@pytest.mark.timeout(240)
def test_trainloop_groups_that_start_together_end_as_one_process(tmp_path: Path) -> None:
    """Three groups meet in the job's first quorum (the lighthouse waits for all three): torchft makes two of
    them take the third's state in that step and zeroes their gradients in its average, so that step trains
    nothing; then every item once per epoch and the weights of one process (they were 2e-2 off when it
    trained)."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", min_replicas=3) as lighthouse:
        _finish([_spawn_loop(f"r{i}", lighthouse.address, out, 0, 0.0) for i, out in enumerate(outs)], outs)
    assert all(r["groups"] == 3 for r in _steps(outs)), "a step was taken by fewer than the three groups"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(outs, outs)


@pytest.mark.timeout(240)
def test_a_trainloop_replica_that_hangs_inside_a_step_fails_that_step_and_is_named(tmp_path: Path) -> None:
    """One of three groups hangs (8 s, heartbeats going on) inside step 31: the two others' step fails at
    the collectives' timeout (5 s) instead of waiting for it, their logs name it, they do the step again
    without it; it comes back, fails its step, takes the state from a peer, and all end as one process."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, -30 if i == 2 else 0) for i, out in enumerate(outs)]
        _finish(processes, outs)
    hung = next(r["hang"] for r in _records(outs[2]) if "hang" in r)
    for out in outs[:2]:
        first = next(r for r in _steps([out]) if r["t"] > hung)
        print(f"{out.name} committed step {first['step']} {first['t'] - hung:.2f} s after the hang began")
        assert (first["step"], first["groups"]) == (30, 2), "the hung step was not redone by the two others"
        assert first["t"] - hung < 8.0, "the others waited for the hung group"
        log = Path(f"{out}.log").read_text()
        assert "step 31 was not committed" in log, log[-3000:]
        assert "r2 left the quorum" in log, log[-3000:]
        # One line per event: the failed step's cause in it, torchft's tracebacks only at debug level.
        assert re.search(r"step 31 was not committed \(replica groups r0, r1, r2\): \w+: .", log), log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    _assert_trains_again(outs[2], hung)
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(outs, outs)


@pytest.mark.timeout(240)
def test_a_fault_tolerant_job_whose_every_group_died_resumes_from_trainloops_checkpoint(tmp_path: Path) -> None:
    """TrainLoop's own checkpoints still restart a whole job: three groups checkpoint every 7 steps (one
    writes); all three die inside step 31; started again on the same checkpoint_dir they resume at step 28,
    part-way through epoch 2, and end with the weights of one process that never stopped (< 1e-5)."""
    outs = [tmp_path / f"r{i}" for i in range(3)]
    checkpoints = tmp_path / "checkpoints"
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, 30, 0.0, str(checkpoints)) for i, out in
                     enumerate(outs)]  # fmt: skip
        for process, out in zip(processes, outs, strict=True):
            process.wait(timeout=120)
            assert process.returncode == -signal.SIGKILL, Path(f"{out}.log").read_text()[-3000:]
        again = [tmp_path / f"r{i}-again" for i in range(3)]
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, 0, 0.05, str(checkpoints)) for i, out in
                     enumerate(again)]  # fmt: skip
        _finish(processes, again)
    assert "resuming from" in Path(f"{again[0]}.log").read_text()
    assert min(r["step"] for r in _steps(again)) == 28, "not resumed from the checkpoint after step 28"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(again, _finals(again), count=False)


_SLURM_TASK = {"SLURM_JOB_ID": "41", "SLURM_JOB_NAME": "digits", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
               "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}  # fmt: skip


@pytest.mark.timeout(240)
def test_slurms_warning_to_one_group_stops_every_group_at_one_step_with_a_checkpoint_they_resume_from(
    tmp_path: Path,
) -> None:
    """Two groups, each a SLURM task with a checkpoint_dir; SIGUSR1 (`#SBATCH --signal=USR1@90`) reaches one of
    them only: it rides with the next step's gradients, so both stop after that same committed step, the group
    that writes checkpoints saves one and says so (once), and both exit with Preempted's status 1. Started
    again, they resume at that step and end with one process's weights."""
    outs = [tmp_path / f"r{i}" for i in range(2)]
    checkpoints = tmp_path / "checkpoints"
    with serve_lighthouse("127.0.0.1", heartbeat_timeout=1.0) as lighthouse:
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, 0, STEP_DELAY_S, str(checkpoints), env=_SLURM_TASK)
                     for i, out in enumerate(outs)]  # fmt: skip
        wait_for(lambda: len(_steps([outs[1]])) >= 20, "20 steps", processes, timeout=120)
        os.kill(processes[1].pid, signal.SIGUSR1)
        for process in processes:
            process.wait(timeout=60)
        logs = [Path(f"{out}.log").read_text() for out in outs]
        assert [process.returncode for process in processes] == [1, 1], [log[-2000:] for log in logs]
        last = [max(r["step"] for r in _steps([out])) for out in outs]
        assert last[0] == last[1], f"the groups stopped after steps {last}"
        said = [line for log in logs for line in log.splitlines() if line.startswith("ddpkit: SIGUSR1 at step")]
        assert said == [f"ddpkit: SIGUSR1 at step {last[0] + 1}: checkpoint saved in {checkpoints}; requeue=False: "
                        "the job stops"], said  # fmt: skip
        again = [tmp_path / f"r{i}-again" for i in range(2)]
        processes = [_spawn_loop(f"r{i}", lighthouse.address, out, 0, 0.05, str(checkpoints)) for i, out in
                     enumerate(again)]  # fmt: skip
        _finish(processes, again)
    assert min(r["step"] for r in _steps(again)) == last[0] + 1, "not resumed after the step both stopped at"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(again, _finals(again), count=False)


@pytest.mark.timeout(300)
def test_slurms_warning_stops_replica_groups_under_their_agents_and_no_agent_starts_them_again(
    tmp_path: Path,
) -> None:
    """`ddpkit run --fault-tolerance -n 2 --max-restarts 2` in a SLURM job (SLURM_JOB_ID), a checkpoint_dir:
    SIGUSR1 to the command, as `srun` passes SLURM's warning on, reaches both groups' ranks through their
    agents; both stop after the same committed step with a checkpoint, and no agent starts them again though
    restarts are left: the command ends with status 1. Started again, they resume after that step and end with
    one process's weights."""
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "job.log"
    trainloop = ["-m", "tests.e2e.ft_trainloop", "-", "-"]
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "2", "--max-restarts", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    first, again = tmp_path / "first", tmp_path / "again"
    first.mkdir(), again.mkdir()
    with open(log, "wb") as output:
        job = subprocess.Popen([*command, *trainloop, str(first), "0", str(STEP_DELAY_S), str(checkpoints)],
                               stdout=output, stderr=subprocess.STDOUT, env={**env, "SLURM_JOB_ID": "41"},
                               start_new_session=True)  # fmt: skip
        outs = [first / "group-0", first / "group-1"]
        wait_for(lambda: len(_steps(outs[1:])) >= 15, "15 steps", [job], timeout=120)
        os.kill(job.pid, signal.SIGUSR1)
        job.wait(timeout=60)
    said = log.read_text(errors="replace")
    assert job.returncode == 1, said[-3000:]
    assert "restart 1 of 2" not in said, said[-3000:]
    stops = re.findall(r"ddpkit: rank 0 stopped \(Preempted: SIGUSR1 at step (\d+)\): the workers are not started "
                       r"again", said)  # fmt: skip
    last = [max(r["step"] for r in _steps([out])) for out in outs]
    assert last[0] == last[1], f"the groups stopped after steps {last}"
    assert [int(step) for step in stops] == [last[0] + 1] * 2, said[-3000:]
    assert [len({r["pid"] for r in _steps([out])}) for out in outs] == [1, 1], "a group was started again"
    done = subprocess.run([*command, *trainloop, str(again), "0", "0.05", str(checkpoints)], capture_output=True,
                          text=True, env=env, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [again / "group-0", again / "group-1"]
    assert min(r["step"] for r in _steps(resumed)) == last[0] + 1, "not resumed after the step both stopped at"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(resumed, _finals(resumed, done.stderr), count=False)


@pytest.mark.timeout(300)
def test_ddpkit_run_fault_tolerance_restarts_a_killed_group_under_its_own_agent_while_the_others_go_on(
    tmp_path: Path,
) -> None:
    """`ddpkit run --fault-tolerance -n 3 --max-restarts 1`, each group's training loader with 2 DataLoader
    workers: group-2 SIGKILLs itself inside step 30; the two others keep their processes and commit within
    2 s; group-2's agent starts it again, it takes the state from a peer and trains in a quorum of three;
    every item once per epoch, weights of one process (which loads in its own process)."""
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "3", "--max-restarts", "1",
               "-m", "tests.e2e.ft_trainloop", "-", "-", str(tmp_path), "30", str(STEP_DELAY_S)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_NUM_WORKERS": "2",
           **_survivors_wait_for_the_restart(tmp_path)}  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restart 1 of 1: local rank 0 was killed by signal SIGKILL" in done.stderr, done.stderr[-3000:]
    assert "ddpkit: replica group group-2: restart 1 of 1: local rank 0 was killed" in done.stderr
    # The survivors name the group that died: gone from their next quorum, or back in it as a new process.
    named = r"replica group group-[01] at step \d+: (.*; )?group-2 (left the quorum|came back as a new process)"
    assert re.search(named, done.stderr), done.stderr[-3000:]
    assert "group None" not in done.stderr
    assert "[None]" not in done.stderr
    outs = [tmp_path / f"group-{i}" for i in range(3)]
    killed = next(r["kill"] for r in _records(outs[2]) if "kill" in r)
    for out in outs[:2]:
        records = _steps([out])
        assert len({r["pid"] for r in records}) == 1, "a survivor was restarted"
        first = next(r for r in records if r["t"] > killed)
        print(f"{out.name} committed step {first['step']} {first['t'] - killed:.2f} s after the kill")
        assert first["t"] - killed < NEXT_COMMIT_S, (
            f"next commit {first['t'] - killed:.2f} s after the kill: {done.stderr[-4000:]}"
        )
    back = [r for r in _steps([outs[2]]) if r["t"] > killed]
    assert len({r["pid"] for r in _steps([outs[2]])}) == 2, "group-2 was not started again"
    assert back[0]["step"] >= 30, "the restarted group started over instead of taking its peers' state"
    assert any(r["groups"] == 3 and r["items"] for r in back), "the restarted group never trained again"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(outs, outs)


@pytest.mark.timeout(300)
def test_a_group_started_again_after_the_others_finished_the_job_trains_nothing_and_the_job_ends(
    tmp_path: Path,
) -> None:
    """`ddpkit run --fault-tolerance -n 3 --max-restarts 1`: group-2 SIGKILLs itself in step 60 of 69, and its
    restart comes only once the two others have finished. It says that the job finished, trains nothing, saves
    nothing, and the job ends with status 0 at once (it once waited quorum_timeout, then trained the whole run
    alone again)."""
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "3", "--max-restarts", "1",
               "-m", "tests.e2e.ft_trainloop", "-", "-", str(tmp_path), "60", str(STEP_DELAY_S)]  # fmt: skip
    survivors = [tmp_path / f"group-{i}" for i in range(2)]
    late = ",".join(f"{out}.json" for out in survivors)  # each writes it when its fit has returned
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_LATE_RESTART": late}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.search(r"ddpkit: replica group group-2: the job finished at step (\d+) \(replica group group-[01] "
                     r"trained its last step\): it trains nothing and ends", done.stderr)  # fmt: skip
    assert said is not None, done.stderr[-3000:]
    assert int(said.group(1)) == 3 * 23, "the job's last step (3 epochs of 23 steps)"
    assert "the job starts with" not in done.stderr, "the late group took itself for a new job"
    records = _records(tmp_path / "group-2")
    killed = next(r for r in records if "kill" in r)
    assert not [r for r in records if "step" in r and r["pid"] != killed["pid"]], "the late group trained"
    assert not (tmp_path / "group-2.json").exists()
    assert not (tmp_path / "group-2.pt").exists()
    for out in survivors:
        assert json.loads(Path(f"{out}.json").read_text())["validation_accuracy"][-1] > 0.8


@pytest.mark.timeout(300)
def test_replica_groups_of_two_ranks_lose_a_rank_restart_that_group_and_end_as_one_process(tmp_path: Path) -> None:
    """`ddpkit run --fault-tolerance -n 4 --group-size 2 --max-restarts 1`: two replica groups of two ranks
    each. Rank 1 of group-1 SIGKILLs itself inside step 30: group-1's agent restarts both its ranks, which take
    group-0's state; group-0 keeps its processes and commits within NEXT_COMMIT_S (4 s). Every item once per
    epoch over the four ranks' shares; each rank's final weights within 1e-5 of one process with the same global
    batch."""
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "4", "--group-size", "2",
               "--max-restarts", "1", "-m", "tests.e2e.ft_trainloop", "-", "-", str(tmp_path), "30",
               str(STEP_DELAY_S), str(tmp_path / "checkpoints")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_KILL_GROUP": "group-1", "FT_KILL_RANK": "1",
           **_survivors_wait_for_the_restart(tmp_path)}  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=270)
    survivors, restarted = check_group_1_lost_rank_1_and_healed(done, tmp_path)
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(survivors + restarted, survivors + restarted)
    saved = TrainState.load(tmp_path / "checkpoints" / "last.pt")
    assert (saved.epoch, saved.global_step) == (3, 69), "the writing group's ranks wrote the last checkpoint"


@pytest.mark.netns
@pytest.mark.timeout(330)
@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_one_command_per_node_makes_each_node_a_replica_group_that_loses_its_ranks_and_heals(
    plugin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two "nodes" (test addresses 10.77.0.1 and 10.77.0.2 in a network namespace of the test's own), each
    `ddpkit run --fault-tolerance --nnodes 2 -n 2 --rdzv-endpoint 10.77.0.1:29510 --secret-file F`: node-a serves
    the lighthouse. Both ranks of node-b SIGKILL themselves in step 30 (epoch 1), then rank 1 of node-a in step 52
    (epoch 2): each time the group's agent restarts its ranks and they heal from the other node's group, which
    keeps its processes and commits within NEXT_COMMIT_S (4 s). Every item once per epoch; every rank's weights
    (with FSDPPlugin, each node's group sharding the model over its two ranks: each group's whole weights) within
    1e-5 of one process; every listener on a test address or loopback."""
    monkeypatch.setenv("FT_PLUGIN", plugin)
    result = in_a_namespace("", tmp_path, module="tests.e2e.netns_ft_nodes", timeout=320)
    logs = "\n".join(result["logs"])
    assert result["codes"] == [0, 0], logs[-4000:]
    assert result["trained"], logs[-4000:]
    assert "torchft's lighthouse at http://10.77.0.1:29510, served by this command" in result["logs"][0], logs[-3000:]
    assert "served by another process; the group's servers listen on 10.77.0.1" in result["logs"][1], logs[-3000:]
    assert "ddpkit: replica group node-b: restart 1 of 1: local rank " in result["logs"][1], logs[-3000:]
    assert "ddpkit: replica group node-a: restart 1 of 1: local rank 1" in result["logs"][0], logs[-3000:]
    listeners = {address for address, _ in result["listeners"]}
    assert listeners <= {"10.77.0.1", "10.77.0.2", "127.0.0.1"}, result["listeners"]
    facing = [port for address, port in result["listeners"] if address == "10.77.0.1"]
    # The lighthouse, each group's store and torchft manager server, and each rank's gloo device of the groups'
    # process group (not the loopback that the group's own default process group is pinned to).
    assert len(facing) >= 1 + 2 + 2 + 4, result["listeners"]
    node_a, node_b = [tmp_path / "node-a", tmp_path / "node-a.rank1"], [tmp_path / "node-b", tmp_path / "node-b.rank1"]
    first = min(r["kill"] for out in node_b for r in _records(out) if "kill" in r)
    second = min(r["kill"] for out in node_a for r in _records(out) if "kill" in r)
    assert first < second, "node-a's rank 1 killed itself before node-b's ranks"
    for killed, since, until, lost, step in ((first, 0.0, second, node_b, 30), (second, first, math.inf, node_a, 52)):
        others = node_a if lost is node_b else node_b
        for out in others:
            records = [r for r in _steps([out]) if since < r["t"] < until]
            assert len({r["pid"] for r in records}) == 1, f"{out.name} was restarted when the other node lost ranks"
            after = next(r for r in records if r["t"] > killed)["t"] - killed
            print(f"{out.name} committed its next step {after:.2f} s after the kill in step {step}")
            assert after < NEXT_COMMIT_S, logs[-4000:]
        for out in lost:
            assert len({r["pid"] for r in _steps([out])}) == 2, f"{out.name} was not started again"
            back = next(r for r in _steps([out]) if r["t"] > killed)["step"]
            assert back >= step, f"{out.name} started over at step {back} instead of taking its peer's state"
    finals = node_a + node_b if plugin == "ddp" else [node_a[0], node_b[0]]  # sharded: rank 0 saves the whole
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(node_a + node_b, finals)


@pytest.mark.netns
@pytest.mark.timeout(330)
def test_a_node_whose_group_comes_back_after_the_other_node_finished_trains_nothing_and_both_end_with_status_0(
    tmp_path: Path,
) -> None:
    """Two "nodes" of two ranks (one `ddpkit run --fault-tolerance --nnodes 2` each, test addresses of a network
    namespace): node-b's ranks SIGKILL themselves in step 60 of 69, and their restart comes only once node-a has
    finished. Started again, node-b's group reads in the job's record beside the lighthouse (which node-a's command
    keeps serving while a group heartbeats) that the job finished, or finds that lighthouse gone when the restart
    came after node-a's command ended, says so, trains nothing and saves nothing; both
    commands end with status 0 (it once trained the whole run alone, then waited quorum_timeout instead)."""
    result = in_a_namespace("late", tmp_path, module="tests.e2e.netns_ft_nodes", timeout=320)
    logs = "\n".join(result["logs"])
    assert result["codes"] == [0, 0], logs[-4000:]
    said = "ddpkit: replica group node-b: the job finished at step 69 (replica group node-a trained its last step)"
    # A restart slower than node-a's command's wait for heartbeats (a loaded machine: 30 s) finds the lighthouse
    # gone with that command: it says so, and ends as well without training.
    gone = "ddpkit: replica group node-b: started again, it reaches no lighthouse that answers"
    assert said in result["logs"][1] or gone in result["logs"][1], logs[-4000:]
    assert "the job starts with" not in logs, "the late group took itself for a new job"
    for out in (tmp_path / "node-b", tmp_path / "node-b.rank1"):
        killed = next(r for r in _records(out) if "kill" in r)
        assert not [r for r in _steps([out]) if r["pid"] != killed["pid"]], f"{out.name} trained again"
        assert not Path(f"{out}.json").exists(), f"{out.name} saved a result"
    for out in (tmp_path / "node-a", tmp_path / "node-a.rank1"):
        assert json.loads(Path(f"{out}.json").read_text())["validation_accuracy"][-1] > 0.8


@pytest.mark.timeout(300)
def test_fit_distributed_with_fault_tolerance_restarts_a_killed_group_and_hands_back_one_processs_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loop.fit_distributed(3, num_processes=3, max_restarts=1)` with `fault_tolerance`: three groups under
    agents of their own, a lighthouse in this process; group-2 kills itself inside step 30 and its agent
    starts it again. This process gets back weights within 1e-5 of one process's and the whole history;
    every item once per epoch."""
    from tests.e2e.ft_trainloop import EPOCHS, StepLog, build_loop

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RUST_LOG", "warn")
    for name, value in _survivors_wait_for_the_restart(tmp_path).items():
        monkeypatch.setenv(name, value)
    loop = build_loop(TorchFT(timeout=5.0, quorum_timeout=30.0))
    loop.kill_at, loop.kill_group, loop.out, loop.folder = 30, "group-2", str(tmp_path), True
    history = loop.fit_distributed(EPOCHS, num_processes=3, max_restarts=1, callbacks=[StepLog(STEP_DELAY_S)])
    assert loop.global_step == 3 * 23, "the steps of three epochs of 1437 items in steps of 64"
    torch.save(loop.model.state_dict(), tmp_path / "fit.pt")
    (tmp_path / "fit.json").write_text(json.dumps(history))
    outs = [tmp_path / f"group-{i}" for i in range(3)]
    assert len({r["pid"] for r in _steps([outs[2]])}) == 2, "group-2 was not started again"
    assert all(len({r["pid"] for r in _steps([out])}) == 1 for out in outs[:2]), "a survivor was restarted"
    _check_every_item_once_per_epoch_and_the_weights_of_one_process(outs, [tmp_path / "fit"])


_USERS_OWN_CLASSES = """
import os, sys, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from ddpkit import Callback, TrainLoop
from ddpkit.examples.digits import digits_datasets
from ddpkit.fault_tolerance import TorchFT

class Digits(Dataset):  # defined in the script, as users do
    def __init__(self, tensors):
        self.images, self.labels = tensors
    def __len__(self):
        return len(self.labels)
    def __getitem__(self, index):
        return self.images[index], self.labels[index]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))
    def forward(self, images):
        return self.layers(images)

def collate(items):
    images, labels = zip(*items)
    return torch.stack(images), torch.stack(labels)

class KeepEachGroups(Callback):  # each group's weights, buffers and validation loss at each epoch's end
    def on_epoch_end(self, train_loop):
        kept = {"state": train_loop.model.state_dict(), "validation_loss": train_loop.state.history["validation_loss"]}
        if os.environ.get("RANK", "0") == "0":  # a group's first rank
            torch.save(kept, f"{os.environ['REPLICA_GROUP_ID']}-{train_loop.epoch}.pt")

if __name__ == "__main__":
    train_set, val_set = digits_datasets(seed=0)
    torch.manual_seed(0)
    model = Net()
    loop = TrainLoop(model, DataLoader(Digits(train_set.tensors), batch_size=16, shuffle=True, collate_fn=collate),
                     DataLoader(Digits(val_set.tensors), batch_size=50, collate_fn=collate),
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.05), global_batch_size=64, progress=False,
                     fault_tolerance=TorchFT(timeout=5.0, quorum_timeout=30.0))
    loop.fit_distributed(2, num_processes=2, callbacks=[KeepEachGroups()])
    torch.save(loop.model.state_dict(), "handed-back.pt")
    print("STEPS", loop.global_step, flush=True)
"""


@pytest.mark.timeout(180)
def test_fit_distributed_with_fault_tolerance_trains_a_users_own_classes_and_every_group_ends_each_epoch_alike(
    tmp_path: Path,
) -> None:
    """A script that defines its Dataset, model (with BatchNorm) and collate function itself (the common case)
    calls `fit_distributed(2, num_processes=2)` with fault tolerance: the groups find the script's classes (as a
    spawned DDP worker does), end each epoch with the same weights, BatchNorm statistics and validation loss,
    and name themselves in their logs."""
    script = tmp_path / "train.py"
    script.write_text(_USERS_OWN_CLASSES)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=170,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STEPS 46" in done.stdout, done.stdout
    said = done.stdout + done.stderr
    assert re.search(r"\[group-[01]\] epoch +2/2", said), said[-3000:]
    # Each group's time per batch rode with the gradients: the writing group names the slowest of both.
    times = re.findall(r"\[group-[01]\] epoch +[12]/2 .* load\+forward ([\d.]+)-([\d.]+) ms/batch \(slowest "
                       r"group-[01]\)$", said, re.M)  # fmt: skip
    assert len(times) == 2, said[-3000:]
    assert all(0 < float(low) <= float(high) for low, high in times), times
    assert "[None]" not in said
    assert "found in sys.modules" not in said, said[-3000:]
    assert "Unable to reset NCCL flight recorder" not in said, "torchft's warning, meaningless without NCCL"
    handed_back = torch.load(tmp_path / "handed-back.pt")
    for epoch in (0, 1):
        kept = [torch.load(tmp_path / f"group-{group}-{epoch}.pt") for group in (0, 1)]
        assert kept[0]["validation_loss"] == kept[1]["validation_loss"], kept
        for name, value in kept[0]["state"].items():
            assert torch.allclose(value.double(), kept[1]["state"][name].double(), rtol=0, atol=1e-6), (epoch, name)
    assert all(torch.equal(value, kept[0]["state"][name]) for name, value in handed_back.items())


@pytest.mark.timeout(240)
def test_fit_distributed_on_two_nodes_makes_each_node_a_replica_group_of_its_processes(tmp_path: Path) -> None:
    """The same script on two "nodes" (two commands on this machine, a lighthouse endpoint on loopback, a job
    secret), each calling `fit_distributed(2, num_processes=2, nnodes=2, rdzv_endpoint=...)`: each node is one
    replica group of 2 ranks (named by `TorchFT(replica_id=...)`: both "nodes" have this machine's host name),
    both groups end each epoch alike, and each process gets its group's weights back."""
    script = tmp_path / "train.py"
    tail = "    loop.fit_distributed(2, num_processes=2, callbacks=[KeepEachGroups()])\n"
    assert tail in _USERS_OWN_CLASSES
    script.write_text(
        _USERS_OWN_CLASSES.replace("fault_tolerance=TorchFT(timeout=5.0, quorum_timeout=30.0))",
                                   "fault_tolerance=TorchFT(replica_id=sys.argv[2], timeout=5.0, quorum_timeout=30.0))")
        .replace(tail, "    loop.fit_distributed(2, num_processes=2, nnodes=2, rdzv_endpoint=sys.argv[1], "
                       "callbacks=[KeepEachGroups()])\n")
        .replace('torch.save(loop.model.state_dict(), "handed-back.pt")',
                 'torch.save(loop.model.state_dict(), f"handed-back-{sys.argv[2]}.pt")')
    )  # fmt: skip
    endpoint = f"127.0.0.1:{free_port_pair()}"  # the lighthouse's port, and its job record's next to it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "DDPKIT_JOB_SECRET": JOB_SECRET}
    nodes = [subprocess.Popen([sys.executable, str(script), endpoint, name], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
             for name in ("node-a", "node-b")]  # fmt: skip
    said = [node.communicate(timeout=220)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(said)[-4000:]
    assert all("STEPS 46" in text for text in said), said
    assert any("replica group 'node-a' (2 ranks), one of 2" in text for text in said), said
    for epoch in (0, 1):
        kept = [torch.load(tmp_path / f"node-{node}-{epoch}.pt") for node in "ab"]
        assert kept[0]["validation_loss"] == kept[1]["validation_loss"], kept
        for name, value in kept[0]["state"].items():
            assert torch.allclose(value.double(), kept[1]["state"][name].double(), rtol=0, atol=1e-6), (epoch, name)
    for node in "ab":
        handed_back = torch.load(tmp_path / f"handed-back-node-{node}.pt")
        assert all(torch.equal(value, kept[0 if node == "a" else 1]["state"][name])
                   for name, value in handed_back.items())  # fmt: skip


@pytest.mark.timeout(240)
def test_groups_whose_weights_part_stop_saying_so_instead_of_training_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One of two groups changes its weights on its own at step 10 (what a bug would do): at that step both
    see that their weights are not the quorum's (norms riding with the gradients) and stop with an error
    naming the step, rather than end with a result that is no one process's."""
    outs = [tmp_path / f"r{i}" for i in range(2)]
    with serve_lighthouse("127.0.0.1", min_replicas=2) as lighthouse:
        first = _spawn_loop("r0", lighthouse.address, outs[0], 0, 0.0, groups=2)
        monkeypatch.setenv("FT_PERTURB_AT", "10")
        second = _spawn_loop("r1", lighthouse.address, outs[1], 0, 0.0, groups=2)
        codes = [process.wait(timeout=120) for process in (first, second)]
    for out, code in zip(outs, codes, strict=True):
        log = Path(f"{out}.log").read_text()
        assert code == 1, log[-3000:]
        assert "weights are not the other groups' at step 11" in log, log[-3000:]
        assert max(r["step"] for r in _steps([out])) == 9, "a step was committed with the weights apart"
