"""Elastic training: a global batch kept on any world size, epochs resumed in entries of the global order.

The unit tests run in the session pool; the two end-to-end tests (marked e2e) start two agents as two
nodes of `--nnodes 1:2` on loopback, then lose one (SIGKILL) or add one part-way through.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from ddpkit import TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.elastic import (
    RecordSteps,
    elastic_train_loop,
    parse_args,
    recorded_steps,
    samples_per_epoch,
)
from ddpkit.examples.retrieval import BalancedBatchSampler
from ddpkit.jobs._agent import node_range, rdzv_configs
from ddpkit.samplers import DistributedSamplerWrapper, EpochLayout
from ddpkit.testing import run_parallel
from ddpkit.training._steps import GlobalBatch
from tests.helpers import StopAfter, wait_for

# --- the global batch: steps and weights ---------------------------------------------------------


def test_a_world_size_that_cannot_reach_the_global_batch_is_refused_naming_those_that_can() -> None:
    assert GlobalBatch(96).accumulation(3, 16) == 2
    with pytest.raises(ValueError, match=r"global_batch_size=64 cannot be reached on 3 rank\(s\) .* runs on 1, 2 rank"):
        GlobalBatch(64).accumulation(3, 32)
    with pytest.raises(ValueError, match="no world size can: make it a multiple of 48"):
        GlobalBatch(64).accumulation(1, 48)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        GlobalBatch(0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 7])
def test_each_item_of_a_step_weighs_one_over_the_steps_items(world_size: int, start: int) -> None:
    """Batches of uneven size (a batch sampler whose last batch is short), a resumed start, a short last step:
    DDP's mean over ranks of each rank's weighted batch means is the mean over the step's items."""
    sizes = torch.tensor([4] * 20 + [3])  # 21 batches of a batch sampler: 83 items
    shuffled = torch.randperm(21, generator=torch.Generator().manual_seed(1))
    layout = EpochLayout(len(sizes), world_size, "uneven", shuffled, sizes, start=start)
    steps = [GlobalBatch(24).epoch(layout, rank, 1, 0, 0) for rank in range(world_size)]
    weight: dict[int, float] = {}  # step -> sum over its items of each item's weight
    positions: dict[int, list[int]] = {}
    for rank, plan in enumerate(steps):
        for index in range(layout.shard_length(rank)):
            step = index // plan.accumulation
            # the batch's items together: 1 / divisor (the batch mean's weight), then DDP's mean over W ranks
            weight[step] = weight.get(step, 0.0) + 1 / plan.divisor(index) / world_size
            positions.setdefault(step, []).append(start + rank + world_size * index)
            assert plan.ends_step(index) == ((index + 1) % plan.accumulation == 0 and step < plan.full_steps)
    assert all(abs(total - 1.0) < 1e-12 for total in weight.values()), weight
    for step, used in positions.items():  # a step holds the positions [start + 6s, start + 6s + 6): 24 items
        assert sorted(used) == list(range(start + 6 * step, min(21, start + 6 * step + 6)))
    assert steps[0].final_step == ((21 - start) % 6 != 0)


# --- training on 1, 2 and 3 ranks ----------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _global_fit(batch: int, global_batch: int, samples: int | None = None, epochs: int = 2) -> dict[str, Any]:
    train, val = digits_datasets(seed=0)
    data = train if samples is None else Subset(train, range(samples))
    model = _model()
    loop = TrainLoop(model, DataLoader(data, batch_size=batch, shuffle=True), DataLoader(val, batch_size=100),
                     optimizer=torch.optim.Adam(model.parameters(), lr=0.01), progress=False,
                     global_batch_size=global_batch)  # fmt: skip
    history = loop.fit(epochs)
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "history": history}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("samples", [None, 64 * 5 + 1], ids=["1438-samples", "321-samples"])
def test_a_global_batch_trains_the_same_on_one_two_and_three_ranks(samples: int | None) -> None:
    """1438 = 22 x 64 + 30: a short last step; 321 = 5 x 64 + 1: on 2 ranks rank 1 has no batch in it (it
    still takes part in the step's all-reduce)."""
    alone = _global_fit(32, 64, samples)
    two = run_parallel(_global_fit, 32, 64, samples, world_size=2, timeout=60)
    assert _max_difference(two[0]["weights"], two[1]["weights"]) == 0.0
    assert _max_difference(two[0]["weights"], alone["weights"]) < 1e-5
    assert two[0]["history"]["train_loss"] == pytest.approx(alone["history"]["train_loss"], rel=1e-6)
    assert two[0]["history"]["validation_accuracy"] == alone["history"]["validation_accuracy"]
    three = run_parallel(_global_fit, 16, 96, samples, world_size=3, timeout=60)
    assert _max_difference(three[2]["weights"], _global_fit(16, 96, samples)["weights"]) < 1e-5
    assert _max_difference(_global_fit(32, 32, samples)["weights"], alone["weights"]) > 1e-3, "tells runs apart"


def _refused(global_batch: int, accumulation: int = 1, drop_last: bool = False) -> str:
    train, _ = digits_datasets(seed=0)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=32, drop_last=drop_last), progress=False,
                     global_batch_size=global_batch)  # fmt: skip
    try:
        loop.fit(1, grad_accumulation=accumulation)
    except ValueError as error:
        return str(error)
    return "trained"


def test_a_world_size_that_cannot_reach_it_raises_on_every_rank() -> None:
    messages = run_parallel(_refused, 64, world_size=3, timeout=60)
    assert all("cannot be reached on 3 rank(s)" in m and "runs on 1, 2 rank(s)" in m for m in messages), messages


def test_a_global_batch_refuses_grad_accumulation_and_drop_last() -> None:
    assert "pass one" in _refused(64, accumulation=2)
    assert "drop_last=False" in _refused(64, drop_last=True)


# --- resuming on another number of ranks ----------------------------------------------------------


def _elastic_args(directory: Path, sampler: str, **more: Any) -> argparse.Namespace:
    args = parse_args(["--checkpoint-dir", str(directory / "checkpoints"), "--record", str(directory / "record"),
                       "--sampler", sampler, "--batch-size", "16", "--global-batch-size", "96",
                       "--checkpoint-every", "4", "--epochs", "2"])  # fmt: skip
    vars(args).update(more)
    return args


def _elastic_fit(args: argparse.Namespace, stop: int | None = None) -> dict[str, torch.Tensor] | str:
    loop = elastic_train_loop(args)
    try:
        loop.fit(args.epochs, callbacks=[RecordSteps(), *([StopAfter(stop)] if stop else [])])
    except KeyboardInterrupt as interrupt:
        return str(interrupt)
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def _expected_epochs(args: argparse.Namespace, epochs: int) -> dict[int, list[int]]:
    """Each epoch's samples as ddpkit deals the training loader out (one rank, no padding)."""
    loader = elastic_train_loop(args).train_loader
    if args.sampler == "items":
        return {epoch: list(range(len(loader.dataset))) for epoch in range(epochs)}  # type: ignore[arg-type]
    assert isinstance(loader.batch_sampler, BalancedBatchSampler)
    wrapper = DistributedSamplerWrapper(loader.batch_sampler, 1, 0, seed=args.seed, even_shards=False)
    expected = {}
    for epoch in range(epochs):
        wrapper.set_epoch(epoch)
        expected[epoch] = sorted(i for batch in wrapper for i in batch)
    return expected


@pytest.mark.parametrize("sampler", ["items", "pk"])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3)])
def test_a_half_done_epoch_resumes_on_another_number_of_ranks(
    tmp_path: Path, sampler: str, before: int, after: int
) -> None:
    """Stop after step 10 of 2 x 15 (checkpoint at step 8, mid-epoch), resume on another world size: every
    training sample is used once per epoch, and the weights are those of an uninterrupted one-process run."""
    args = _elastic_args(tmp_path, sampler)
    stopped = run_parallel(_elastic_fit, args, 10, world_size=before, timeout=60)
    assert stopped[0] == "stopped after step 10"
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / CHECKPOINT_FILE)
    assert (checkpoint["global_step"], checkpoint["epoch"], checkpoint["world_size"]) == (8, 0, before)
    assert checkpoint["position"] == 8 * (96 if sampler == "items" else 96 // 16), "entries of the global order"
    resumed = run_parallel(_elastic_fit, args, world_size=after, timeout=60)
    steps = recorded_steps(tmp_path / "record")
    assert {len(steps[s]) for s in range(1, 9)} == {before}, "steps 1-8 count as the first run did them"
    assert {len(steps[s]) for s in range(9, len(steps) + 1)} == {after}, "steps 9 and 10 were done again"
    assert samples_per_epoch(tmp_path / "record") == _expected_epochs(args, 2)
    reference = _elastic_fit(_elastic_args(tmp_path / "alone", sampler))
    assert isinstance(reference, dict)
    assert isinstance(resumed[0], dict)
    assert _max_difference(resumed[0], reference) < 1e-5


def _dropout_fit(directory: str, stop: int | None) -> dict[str, torch.Tensor] | str:
    train, _ = digits_datasets(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))
    loop = TrainLoop(model, DataLoader(train, batch_size=32, shuffle=True), progress=False, checkpoint_dir=directory,
                     checkpoint_every=4, global_batch_size=64)  # fmt: skip
    try:
        loop.fit(2, callbacks=[StopAfter(stop)] if stop else None)
    except KeyboardInterrupt as interrupt:
        return str(interrupt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_with_dropout_a_run_resumed_on_as_many_ranks_is_bit_identical(tmp_path: Path) -> None:
    """Each batch's random numbers are seeded from its position in the epoch, not from the run's history."""
    uninterrupted = run_parallel(_dropout_fit, str(tmp_path / "a"), None, timeout=60)
    assert run_parallel(_dropout_fit, str(tmp_path / "b"), 10, timeout=60)[0] == "stopped after step 10"
    resumed = run_parallel(_dropout_fit, str(tmp_path / "b"), None, timeout=60)
    assert all(torch.equal(resumed[0][k], uninterrupted[0][k]) for k in uninterrupted[0])  # type: ignore[index]
    alone = _dropout_fit(str(tmp_path / "c"), None)
    assert isinstance(alone, dict)
    assert _max_difference(alone, uninterrupted[0]) > 1e-4, "dropout draws per batch: one rank draws otherwise"


def _accumulating_fit(directory: str, stop: int | None) -> tuple[str, list[str]]:
    train, _ = digits_datasets(seed=0)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=32, shuffle=True), progress=False,
                     checkpoint_dir=directory, checkpoint_every=4)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loop.fit(2, callbacks=[StopAfter(stop)] if stop else None)
        except KeyboardInterrupt as interrupt:
            return str(interrupt), []
    return f"finished at step {loop.global_step}", [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_without_a_global_batch_a_resize_warns_and_goes_on_with_what_is_left(tmp_path: Path) -> None:
    """23 steps per epoch on 2 ranks (1438 / 64); stopped after step 6 (checkpoint at 4: 256 entries done); on 3
    ranks the rest of epoch 0 is 1182 entries: 13 batches of 32 per rank (padded), then 15 per epoch."""
    stopped = run_parallel(_accumulating_fit, str(tmp_path), 6, world_size=2, timeout=60)
    assert stopped[0] == ("stopped after step 6", [])
    finished = run_parallel(_accumulating_fit, str(tmp_path), None, world_size=3, timeout=60)
    assert [outcome for outcome, _ in finished] == ["finished at step 32"] * 3
    assert all(len(said) == 1 and "Give TrainLoop a global_batch_size" in said[0] for _, said in finished)


def test_a_checkpoint_of_ddpkit_0_1_resumes_at_its_batch(tmp_path: Path) -> None:
    """Version 1 counted the position in batches per rank; it is read as that many entries of all ranks."""
    train, _ = digits_datasets(seed=0)

    def loop(directory: Path) -> TrainLoop:
        return TrainLoop(_model(), DataLoader(train, batch_size=32, shuffle=True), progress=False, seed=2,
                         checkpoint_dir=directory, checkpoint_every=5)  # fmt: skip

    with pytest.raises(KeyboardInterrupt):
        loop(tmp_path / "new").fit(1, callbacks=[StopAfter(6)])  # the checkpoint of step 5 stays
    state = load_checkpoint(tmp_path / "new" / CHECKPOINT_FILE)
    assert (state.pop("version"), state["position"], state.pop("stream")) == (4, 5 * 32, None)
    assert (state.pop("recipe"), state.pop("skipped_steps")) == ({}, 0), "fields that version 1 lacks"
    state["batch"] = state.pop("position") // 32
    save_checkpoint({"version": 1, **state}, tmp_path / "old" / CHECKPOINT_FILE)
    new, old = loop(tmp_path / "new"), loop(tmp_path / "old")
    new.fit(1)
    old.fit(1)
    assert _max_difference(new.model.state_dict(), old.model.state_dict()) == 0.0
    assert new.history["train_loss"] == old.history["train_loss"]


# --- launching: nnodes MIN:MAX ----------------------------------------------------------------------


def test_nnodes_takes_a_number_or_torchruns_min_max() -> None:
    assert [node_range(n) for n in (1, "3", "1:2", " 2:4 ")] == [(1, 1), (3, 3), (1, 2), (2, 4)]
    for bad in (0, "2:1", "a", "1:", True, "0:2"):
        with pytest.raises(ValueError, match="must be a number of nodes >= 1, or 'MIN:MAX'"):
            node_range(bad)  # type: ignore[arg-type]
    assert rdzv_configs(9.6, "last_call_timeout=2, keep_alive_interval=1") == {
        "last_call_timeout": "2", "keep_alive_interval": "1", "join_timeout": 10,
    }  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        rdzv_configs(None, "last_call_timeout")


def test_losing_the_rendezvous_host_is_named() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from ddpkit.jobs._agent import _rendezvous_failed

    message = str(_rendezvous_failed(RendezvousConnectionError("lost"), "127.0.0.1:29400", "1:2", None))
    assert "cannot reach the rendezvous store at 127.0.0.1:29400" in message
    assert "a job survives losing any node but that one" in message


# --- end to end: two agents, one lost or one added -------------------------------------------------

#: Short heartbeats and last call, so that a lost node is noticed in 3 s and the group re-forms 2 s later.
_FAST_RDZV = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _agent(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


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
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


def _finish(process: subprocess.Popen[bytes], log: Path) -> None:
    try:
        process.wait(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"timed out:\n{log.read_text()[-3000:]}")
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_job_that_loses_a_node_mid_epoch_finishes_on_one_with_the_same_result(tmp_path: Path) -> None:
    """Two `ddpkit run --nnodes 1:2` agents, one process each; SIGKILL the second agent and its worker in the
    middle of epoch 2 (0-based 1). The first finishes alone: every sample once per epoch, and the weights of
    an uninterrupted 2-rank run."""
    port = _free_port()
    example = ["-m", "ddpkit.examples.elastic", "--checkpoint-dir", str(tmp_path / "checkpoints"),
               "--record", str(tmp_path / "record"), "--step-delay", "0.1"]  # fmt: skip
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
    reference = run_parallel(_uninterrupted, parse_args(["--checkpoint-dir", str(tmp_path / "none")]),
                             world_size=2, timeout=60)[0]  # fmt: skip
    assert _max_difference(torch.load(tmp_path / "weights.pt"), reference) < 1e-5


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_job_that_gains_a_node_mid_epoch_goes_on_on_two_with_the_same_result(tmp_path: Path) -> None:
    """`fit_distributed(nnodes="1:2")` in one agent, P x K batches; a second agent joins during epoch 1 (0-based
    0): the run goes on on two ranks, every batch once per epoch, the weights of an uninterrupted 2-rank run."""
    port = _free_port()
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
    assert {(0, 1), (0, 2), (2, 2)} <= worlds, worlds
    args = parse_args(["--checkpoint-dir", str(tmp_path / "none"), "--sampler", "pk"])
    assert samples_per_epoch(record) == _expected_epochs(args, 3)
    resized = min(line["time"] for lines in steps.values() for line in lines if line["world_size"] == 2) - joined
    print(f"from the second agent's start to its first step: {resized:.1f} s")
    reference = run_parallel(_uninterrupted, args, world_size=2, timeout=60)[0]
    assert _max_difference(torch.load(tmp_path / "weights.pt"), reference) < 1e-5
