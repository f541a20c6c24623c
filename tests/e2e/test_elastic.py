"""Elastic training: a global batch kept on any world size, epochs resumed in entries of the global order.

Here, the tests that start fresh processes; the others are in tests/unit/test_elastic.py and
tests/ranks/test_elastic.py.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.examples.elastic import (
    elastic_train_loop,
    parse_args,
    recorded_steps,
    samples_per_epoch,
)
from ddpkit.testing import run_parallel
from tests.helpers import free_port, wait_for
from tests.support.elastic import _expected_epochs, _max_difference

# --- end to end: two agents, one lost or one added -------------------------------------------------


def _agent(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


#: Short heartbeats and last call, so that a lost node is noticed in 3 s and the group re-forms 2 s later.
_FAST_RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _steps_of(record: Path, epoch: int, world_size: int) -> int:
    if not record.exists():
        return 0
    return len({s for s, lines in recorded_steps(record).items() for line in lines
                if (line["epoch"], line["world_size"]) == (epoch, world_size)})  # fmt: skip


def _uninterrupted(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    loop = elastic_train_loop(args)
    loop.fit(args.epochs)
    return loop.full_state_dict()


def _finish(process: subprocess.Popen[bytes], log: Path) -> None:
    try:
        process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"timed out:\n{log.read_text()[-3000:]}")
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_job_that_loses_a_node_mid_epoch_finishes_on_one_with_the_same_result(tmp_path: Path, sharded: bool) -> None:
    """Two `ddpkit run --nnodes 1:2` agents, one process each; SIGKILL the second agent and its worker in the
    middle of epoch 2 (0-based 1). The first finishes alone: every sample once per epoch, and the weights of
    an uninterrupted 2-rank run. Sharded (FSDPPlugin), the lone rank resumes from the 2 ranks' sharded
    checkpoint, resharded for 1."""
    port = free_port()
    example = ["-m", "ddpkit.examples.elastic", "--checkpoint-dir", str(tmp_path / "checkpoints"),
               "--record", str(tmp_path / "record"), "--step-delay", "0.1"]  # fmt: skip
    example += ["--sharded"] if sharded else []
    agent = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-conf", _FAST_RDZV, "--max-restarts", "3", *example]  # fmt: skip
    first = _agent([*agent, "--out", str(tmp_path / "weights.pt")], tmp_path / "first.log")
    wait_for(lambda: _listening(port), "the first agent's rendezvous store", [first])  # it hosts the store
    second = _agent(agent, tmp_path / "second.log")
    record = tmp_path / "record"
    wait_for(lambda: _steps_of(record, 1, 2) >= 10, "step 10 of epoch 2 on two ranks", [first, second])
    os.killpg(second.pid, signal.SIGKILL)  # the agent and its worker
    killed = time.time()
    _finish(first, tmp_path / "first.log")
    steps = recorded_steps(record)
    worlds = {(line["epoch"], line["world_size"]) for lines in steps.values() for line in lines}
    assert {(1, 2), (1, 1), (2, 1)} <= worlds, worlds
    assert samples_per_epoch(record) == {epoch: list(range(1438)) for epoch in range(3)}
    resized = min(line["time"] for lines in steps.values() for line in lines if line["time"] > killed) - killed
    print(f"from the kill to the next step: {resized:.1f} s")
    options = ["--checkpoint-dir", str(tmp_path / "none"), *(["--sharded"] if sharded else [])]
    reference = run_parallel(_uninterrupted, parse_args(options), world_size=2, timeout=60)[0]
    assert _max_difference(torch.load(tmp_path / "weights.pt"), reference) < 1e-5
    if sharded:
        assert any(path.name.endswith(".dcp") for path in (tmp_path / "checkpoints").iterdir())


@pytest.mark.timeout(240)
def test_a_job_that_gains_a_node_mid_epoch_goes_on_on_two_with_the_same_result(tmp_path: Path) -> None:
    """`fit_distributed(nnodes="1:2")` in one agent, P x K batches; a second agent joins during epoch 1 (0-based
    0): the run goes on on two ranks, every batch once per epoch, the weights of an uninterrupted 2-rank run."""
    port = free_port()
    common = [sys.executable, "-m", "ddpkit.examples.elastic", "--nnodes", "1:2", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-conf", _FAST_RDZV, "--checkpoint-dir", str(tmp_path / "checkpoints"),
              "--record", str(tmp_path / "record"), "--sampler", "pk", "--step-delay", "0.3",
              "--checkpoint-every", "1"]  # fmt: skip
    first = _agent([*common, "--out", str(tmp_path / "weights.pt")], tmp_path / "first.log")
    record = tmp_path / "record"
    # 22 steps of 0.6 s on one rank: the second agent, started after the first, joins well inside epoch 1.
    # A checkpoint at every step: a join before the first step's checkpoint would redo (and re-record) it on two.
    wait_for(lambda: _steps_of(record, 0, 1) >= 1, "the first step on one rank", [first])
    joined = time.time()
    second = _agent(common, tmp_path / "second.log")
    _finish(first, tmp_path / "first.log")
    _finish(second, tmp_path / "second.log")
    steps = recorded_steps(record)
    worlds = {(line["epoch"], line["world_size"]) for lines in steps.values() for line in lines}
    # The join lands inside epoch 0 on a quiet machine, inside epoch 1 on a loaded one: either way mid-epoch.
    resized_in = [epoch for epoch in range(3) if {(epoch, 1), (epoch, 2)} <= worlds]
    assert resized_in, worlds
    assert {(0, 1), (2, 2)} <= worlds, worlds
    args = parse_args(["--checkpoint-dir", str(tmp_path / "none"), "--sampler", "pk"])
    assert samples_per_epoch(record) == _expected_epochs(args, 3)
    resized = min(line["time"] for lines in steps.values() for line in lines if line["world_size"] == 2) - joined
    print(f"from the second agent's start to its first step: {resized:.1f} s")
    reference = run_parallel(_uninterrupted, args, world_size=2, timeout=60)[0]
    assert _max_difference(torch.load(tmp_path / "weights.pt"), reference) < 1e-5
