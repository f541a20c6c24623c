"""TrainLoop: DDP equals one process (item and batch samplers), exact metrics, bit-identical resume.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_train_loop.py.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Sampler, TensorDataset

from ddpkit import Callback, TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ddpkit.examples.digits import digits_datasets, load_digits
from ddpkit.testing import run_parallel
from ddpkit.training import TrainState
from tests.helpers import StopAfter
from tests.support.train_loop import _model

# --- run in the workers (top level: pickled by reference) -----------------------------------


class _ShuffledBatches(Sampler[list[int]]):
    """A custom batch sampler (not a stock one): ``n // size`` shuffled batches from its ``generator``."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size
        self.generator: torch.Generator | None = None

    def __len__(self) -> int:
        return self.n // self.size

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(self.n, generator=self.generator)
        for k in range(len(self)):
            yield order[k * self.size : (k + 1) * self.size].tolist()


def _fit(
    batch_size: int, epochs: int, accumulation: int = 1, batch_sampler: bool = False, momentum: float = 0.0
) -> dict[str, torch.Tensor]:
    """Plain SGD, mean cross-entropy, shuffled digits; the trained weights."""
    train, _ = digits_datasets(seed=0)
    model = _model()
    if batch_sampler:
        loader = DataLoader(train, batch_sampler=_ShuffledBatches(len(train), batch_size))
    else:
        loader = DataLoader(train, batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    loop = TrainLoop(model, loader, optimizer=optimizer, progress=False, seed=3)
    loop.fit(epochs, grad_accumulation=accumulation)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _evaluate_full_digits(batch_size: int, samples: int | None = None) -> dict[str, float]:
    images, labels = load_digits()
    data = TensorDataset(torch.from_numpy(images)[:samples], torch.from_numpy(labels)[:samples])
    train, _ = digits_datasets(seed=0)
    model = _model()
    loop = TrainLoop(model, DataLoader(train, batch_size=64), DataLoader(data, batch_size=batch_size), progress=False)
    return loop.evaluate()


def _resumable_run(directory: str, stop: StopAfter | None, asynchronous: bool = False
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:  # fmt: skip
    """Dropout (the global RNG), momentum (optimizer state), shuffling: all must come back exactly."""
    train, val = digits_datasets(seed=0)
    model = _model(dropout=0.3)
    loop = TrainLoop(
        model,
        DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(val, batch_size=100),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        checkpoint_dir=directory,
        checkpoint_every=5,
        checkpoint_async=asynchronous,
        progress=False,
        seed=1,
    )
    outcome = "finished"
    try:
        loop.fit(2, callbacks=[stop] if stop else None)
    except KeyboardInterrupt as interrupt:
        outcome = str(interrupt)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, dict(loop.history), outcome


class _StopAt(Callback):
    """Sets ``should_stop`` after step ``step`` (on every rank): a stop requested, not a crash."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, train_loop: Any) -> None:
        train_loop.should_stop = train_loop.global_step == self.step


def _budgeted_run(directory: str, stop_at: int | None) -> tuple[dict[str, torch.Tensor], dict[str, Any], int, str]:
    """``fit(max_steps=40)`` evaluating every 15 steps and checkpointing every 30 (epochs of 23 steps of 2 x 32),
    stopped by a callback after ``stop_at``: weights, history, steps, what rank 0 printed."""
    train, val = digits_datasets(seed=0)
    model = _model(dropout=0.3)
    loop = TrainLoop(
        model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=100),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), checkpoint_dir=directory,
        checkpoint_every=30, evaluate_every=15, progress=False, seed=1,
    )  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = loop.fit(max_steps=40, callbacks=[_StopAt(stop_at)] if stop_at else None)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return weights, history, loop.global_step, out.getvalue()


def _quiet_ranks(batch_size: int) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    train, val = digits_datasets(seed=0)
    model = _model()
    loop = TrainLoop(model, DataLoader(train, batch_size=batch_size), DataLoader(val, batch_size=100))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        loop.fit(1)
    return out.getvalue(), err.getvalue()


class _CountAllReduces(Callback):
    """Registers a comm hook that counts DDP's gradient all-reduces (one bucket: one per synchronised step)."""

    def __init__(self) -> None:
        self.calls = [0]

    def on_train_begin(self, train_loop: Any) -> None:
        calls = self.calls

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            calls[0] += 1
            return default_hooks.allreduce_hook(state, bucket)

        train_loop.ddp_model.register_comm_hook(None, hook)


def _count_all_reduces(accumulation: int) -> tuple[int, int]:
    train, _ = digits_datasets(seed=0)
    model = _model()
    counter = _CountAllReduces()
    loop = TrainLoop(model, DataLoader(train, batch_size=100), progress=False)
    loop.fit(1, grad_accumulation=accumulation, callbacks=[counter])
    return counter.calls[0], loop.global_step


# --- equivalence ------------------------------------------------------------------------------


def test_two_ranks_of_batch_b_equal_one_process_of_batch_2b() -> None:
    """The headline: DDP is the single-process run, parameter for parameter (2 epochs, plain SGD)."""
    distributed = run_parallel(_fit, 32, 2, world_size=2, timeout=60)
    single = _fit(64, 2)
    assert _max_difference(distributed[0], distributed[1]) == 0.0, "the ranks hold the same weights"
    assert _max_difference(distributed[0], single) < 1e-5
    untrained = _model().state_dict()
    assert _max_difference(single, untrained) > 0.1, "training moved the weights"
    assert _max_difference(_fit(32, 2), single) > 1e-3, "the comparison can tell different runs apart"


def test_two_ranks_with_a_batch_sampler_equal_one_process_accumulating_two_batches() -> None:
    distributed = run_parallel(_fit, 32, 2, 1, True, world_size=2, timeout=60)
    single = _fit(32, 2, accumulation=2, batch_sampler=True)
    assert _max_difference(distributed[0], single) < 1e-5
    assert _max_difference(_fit(32, 2, batch_sampler=True), single) > 1e-3


def test_accumulation_skips_the_all_reduce_of_non_final_micro_batches() -> None:
    # 1438 samples / 100 per batch = 15 batches on one rank, 8 on each of 2 (padded).
    plain, accumulated = run_parallel(_count_all_reduces, 1), run_parallel(_count_all_reduces, 3)
    assert plain == [(8, 8)] * 2
    assert accumulated == [(3, 3)] * 2, "batches 3, 6 and the last one (8) step and synchronise"


# --- exact metrics ----------------------------------------------------------------------------


def test_three_ranks_give_the_single_process_accuracy_exactly() -> None:
    """1797 samples on 3 ranks, batches of 100: uneven shards, partial batches, not one duplicate."""
    single = _evaluate_full_digits(100)
    results = run_parallel(_evaluate_full_digits, 100, world_size=3, timeout=60)
    assert [r["accuracy"] for r in results] == [single["accuracy"]] * 3
    assert results[0]["loss"] == pytest.approx(single["loss"], rel=1e-6)
    assert 0.0 < single["accuracy"] < 1.0, "an untrained model: far from a trivial 0 or 1"


def test_a_rank_without_validation_samples_still_takes_part() -> None:
    single = _evaluate_full_digits(1, samples=2)
    results = run_parallel(_evaluate_full_digits, 1, 2, world_size=3)
    assert [r["accuracy"] for r in results] == [single["accuracy"]] * 3


# --- checkpoints and resume -------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop",
    [StopAfter(step=12), StopAfter(epoch=1)],
    ids=["mid-epoch-after-step-12", "at-an-epoch-boundary"],
)
def test_a_resumed_run_ends_bit_identical_to_an_uninterrupted_one(tmp_path: Path, stop: StopAfter) -> None:
    uninterrupted = run_parallel(_resumable_run, str(tmp_path / "a"), None, timeout=60)
    stopped = run_parallel(_resumable_run, str(tmp_path / "b"), stop, timeout=60)
    assert stopped[0][2].startswith("stopped")
    checkpoint = load_checkpoint(tmp_path / "b" / CHECKPOINT_FILE)
    # The position counts entries of the epoch's global order: 10 batches of 32 on each of 2 ranks.
    assert (checkpoint["epoch"], checkpoint["position"]) == ((0, 10 * 32 * 2) if stop.step else (1, 0))
    resumed = run_parallel(_resumable_run, str(tmp_path / "b"), None, timeout=60)
    for rank in (0, 1):
        weights, history, outcome = resumed[rank]
        assert outcome == "finished"
        assert all(torch.equal(weights[k], uninterrupted[rank][0][k]) for k in weights), "bit-identical"
        assert history["validation_accuracy"] == uninterrupted[rank][1]["validation_accuracy"]
        assert history["train_loss"] == pytest.approx(uninterrupted[rank][1]["train_loss"], rel=1e-12)
    assert not all(torch.equal(stopped[0][0][k], uninterrupted[0][0][k]) for k in weights), "the stop was real"


def test_max_steps_and_a_callbacks_stop_end_inside_an_epoch_with_its_checkpoint_and_resume_to_the_same_run(
    tmp_path: Path,
) -> None:
    """max_steps=40 ends inside the second epoch (23 steps each); should_stop after step 20 (not a multiple of
    checkpoint_every) ends the run there with step 20's checkpoint, and the resumed run ends bit-identical to the
    uninterrupted one, with the same evaluations at steps 15 and 30 and the same epoch line."""
    whole = run_parallel(_budgeted_run, str(tmp_path / "a"), None, timeout=60)
    stopped = run_parallel(_budgeted_run, str(tmp_path / "b"), 20, timeout=60)
    checkpoint = load_checkpoint(tmp_path / "b" / CHECKPOINT_FILE)
    assert (checkpoint["global_step"], checkpoint["epoch"], checkpoint["position"]) == (20, 0, 20 * 32 * 2)
    assert [rank[2] for rank in stopped] == [20, 20]
    assert "epoch  1  stopped after step 20 (a callback set should_stop)  train loss" in stopped[0][3]
    assert stopped[1][3] == "", "rank 0 alone prints"
    assert "train_loss" not in stopped[0][1], "the epoch has not ended"
    resumed = run_parallel(_budgeted_run, str(tmp_path / "b"), None, timeout=60)
    for rank in (0, 1):
        weights, history, steps, _ = resumed[rank]
        assert steps == whole[rank][2] == 40
        assert all(torch.equal(weights[k], whole[rank][0][k]) for k in weights), "bit-identical"
        assert history["eval_step"] == whole[rank][1]["eval_step"] == [15.0, 30.0]
        assert history["eval_accuracy"] == whole[rank][1]["eval_accuracy"]
        assert history["train_loss"] == pytest.approx(whole[rank][1]["train_loss"], rel=1e-12)
        assert len(history["train_loss"]) == 1, "one epoch ended; the second stopped at step 40"
    assert "resuming from" in resumed[0][3]
    assert "after 20 of 40 optimizer steps" in resumed[0][3]
    assert "epoch  2  stopped after step 40 (max_steps=40)" in whole[0][3]
    assert "step 15 (epoch 1)  validation loss" in whole[0][3]
    done = run_parallel(_budgeted_run, str(tmp_path / "b"), None, timeout=60)
    assert done[0][3].startswith(f"already trained 40 of max_steps=40 optimizer steps in {tmp_path / 'b'}")
    assert done[0][2] == 40


def test_async_checkpoints_resume_a_crashed_run_bit_identical(tmp_path: Path) -> None:
    """checkpoint_async=True on 2 ranks: a crash after step 12 (the checkpoint of step 10 written in the background)
    resumes, asynchronously too, to the uninterrupted run's weights."""
    uninterrupted = run_parallel(_resumable_run, str(tmp_path / "a"), None, timeout=60)
    stopped = run_parallel(_resumable_run, str(tmp_path / "b"), StopAfter(step=12), True, timeout=60)
    assert stopped[0][2] == "stopped after step 12"
    checkpoint = load_checkpoint(tmp_path / "b" / CHECKPOINT_FILE)
    assert checkpoint["global_step"] == 10
    resumed = run_parallel(_resumable_run, str(tmp_path / "b"), None, True, timeout=60)
    for rank in (0, 1):
        assert all(torch.equal(resumed[rank][0][k], uninterrupted[rank][0][k]) for k in resumed[rank][0])
        assert resumed[rank][1]["validation_accuracy"] == uninterrupted[rank][1]["validation_accuracy"]
    assert load_checkpoint(tmp_path / "b" / CHECKPOINT_FILE)["epoch"] == 2, "the last one on disk when fit returned"


def _fit_in_own_directory(directory: str) -> str:
    """A TrainLoop whose checkpoint_dir is another directory on each rank (as each node's own disk would be)."""
    from ddpkit import get_rank

    train, _ = digits_datasets(seed=0)
    loop = TrainLoop(_model(), DataLoader(train, batch_size=64), progress=False,
                     checkpoint_dir=f"{directory}/node-{get_rank()}")  # fmt: skip
    try:
        loop.fit(1)
    except ValueError as refused:
        return f"{refused} (steps {loop.global_step})"
    return "trained"


def test_a_checkpoint_dir_that_is_not_the_same_on_every_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_parallel(_fit_in_own_directory, str(tmp_path), timeout=60)
    for rank, result in enumerate(results):
        assert "is not the same directory on every rank: rank(s) [1] do not see a file rank 0 wrote" in result
        assert f"this is rank {rank}" in result
        assert "put checkpoint_dir on a shared file system" in result
        assert result.endswith("(steps 0)"), "refused before training"
    assert sorted(p.name for p in (tmp_path / "node-0").iterdir()) == [], "the probe file is gone"


def _printed_run(directory: str, stop: StopAfter | None) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        weights, history, _ = _resumable_run(directory, stop)
    return weights, history, out.getvalue()


def test_a_finished_run_started_again_trains_no_further_and_says_so(tmp_path: Path) -> None:
    first = run_parallel(_resumable_run, str(tmp_path), None, timeout=60)
    again = run_parallel(_printed_run, str(tmp_path), None, timeout=60)
    assert all(torch.equal(again[0][0][k], first[0][0][k]) for k in first[0][0])
    assert again[0][1] == first[0][1]
    assert again[0][2] == (
        f"already trained 2 of 2 epochs in {tmp_path}; nothing to do: delete it, pass a new checkpoint_dir, "
        "or ask for more epochs\n"
    )
    assert again[1][2] == "", "rank 0 alone prints"


def test_a_resumed_run_says_where_it_resumes(tmp_path: Path) -> None:
    run_parallel(_resumable_run, str(tmp_path), StopAfter(step=30), timeout=60)
    resumed = run_parallel(_printed_run, str(tmp_path), None, timeout=60)
    first_line = resumed[0][2].splitlines()[0]  # epochs of 23 steps of 2 x 32; the stop came before step 30's save
    assert first_line == f"resuming from {tmp_path}: epoch 2/2, 128 entries into it, after 25 optimizer steps"
    assert "epoch  2/2  train loss" in resumed[0][2]


# --- behaviour ---------------------------------------------------------------------------------


def test_only_rank_zero_prints_and_shows_progress() -> None:
    (out0, err0), (out1, err1) = run_parallel(_quiet_ranks, 64, timeout=60)
    assert out0.count("epoch  1/1  train loss") == 1
    assert "validation accuracy" in out0
    assert "/1438 [" in err0, "rank 0's progress bar of the epoch's items"
    assert "item/s" in err0
    assert (out1, err1) == ("", "")


# --- the straggler view -----------------------------------------------------------------------------


def _slow_collate_on_rank_one(rows: list[Any]) -> Any:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(0.04)  # a slow data pipeline on one rank: 40 ms, well above a loaded machine's noise
    return torch.utils.data.default_collate(rows)


def _step_times() -> tuple[list[float], str]:
    train, _ = digits_datasets(seed=0)
    model = _model()
    loader = DataLoader(train, batch_size=64, shuffle=True, collate_fn=_slow_collate_on_rank_one)
    loop = TrainLoop(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        loop.fit(1)
    return loop.step_times, printed.getvalue()


def test_each_epoch_names_the_slowest_rank_before_it_becomes_a_hang() -> None:
    (times, line), (times_1, nothing) = run_parallel(_step_times)
    assert times == times_1, "every rank knows every rank's time"
    assert times[1] > times[0] + 25, "rank 1 spends 40 ms more per batch loading (ms)"
    assert f"load+forward {min(times):.1f}-{max(times):.1f} ms/batch (slowest rank 1)" in line
    assert nothing == "", "rank 0 alone prints"


# --- failures inside the loop -------------------------------------------------------------------------------


def _failed_checkpoint_write(directory: str) -> tuple[str, float]:
    import time

    import torch.distributed as dist

    train, _ = digits_datasets(seed=0)
    model = _model()
    loop = TrainLoop(model, DataLoader(train, batch_size=64), progress=False, checkpoint_dir=directory)
    original = TrainState.save

    def full_disk(self: Any, path: Any) -> None:
        raise OSError(28, "No space left on device", str(path))

    TrainState.save = full_disk  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        loop.fit(1)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    finally:
        TrainState.save = original  # type: ignore[method-assign]
        dist.barrier()
    return "no error", time.monotonic() - started


def test_a_failed_checkpoint_write_stops_every_rank_at_once(tmp_path: Path) -> None:
    """Before, the other ranks waited in a barrier after it until the process-group timeout."""
    (rank0, took0), (rank1, took1) = run_parallel(_failed_checkpoint_write, str(tmp_path), timeout=60)
    assert rank0.startswith("OSError: [Errno 28] No space left on device")
    assert rank1.startswith(f"DDPKitError: rank 0 could not write the checkpoint {tmp_path / 'last.pt'}, so rank 1")
    assert "No space left on device" in rank1
    assert max(took0, took1) < 10, "far below the process group's timeout"
