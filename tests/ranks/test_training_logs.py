"""TrainLoop's loggers, early stopping and best weights on 2 ranks: one writer, the whole split's numbers, resumable.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_training_logs.py.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import Callback, CSVLogger, EarlyStopping, ModelCheckpoint, TensorBoardLogger, TrainLoop
from ddpkit.checkpoint import load_checkpoint
from ddpkit.examples.digits import digits_datasets
from ddpkit.testing import run_parallel


class _Record(Callback):
    """Every rank's step losses, and rank 0's weights after each epoch."""

    def __init__(self) -> None:
        self.step_losses: dict[int, list[float]] = {}
        self.weights: list[dict[str, torch.Tensor]] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.step_losses[train_loop.global_step] = train_loop.step_loss.tolist()

    def on_epoch_end(self, train_loop: Any) -> None:
        self.weights.append({k: v.detach().clone() for k, v in train_loop.model.state_dict().items()})


class _StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, train_loop: Any) -> None:
        if train_loop.global_step == self.step:
            raise KeyboardInterrupt(f"stopped after step {self.step}")


def _loop(checkpoint_dir: str | None = None, evaluate_every: int | None = None) -> TrainLoop:
    train, val = digits_datasets(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    return TrainLoop(
        model,
        DataLoader(train, batch_size=32, shuffle=True),
        DataLoader(val, batch_size=100),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=5 if checkpoint_dir else None,
        evaluate_every=evaluate_every,
        progress=False,
    )


def _logged_run(out: str, epochs: int) -> tuple[dict[str, list[float]], dict[int, list[float]]]:
    loop, record = _loop(), _Record()
    callbacks = [TensorBoardLogger(f"{out}/tb", log_every_n_steps=5), CSVLogger(f"{out}/metrics.csv", 5), record]
    history = loop.fit(epochs, callbacks=callbacks)
    return history, record.step_losses


#: What each epoch measures of the machine (its speed, its memory): logged once an epoch, but no two runs agree.
_MEASURED = ("items_per_second", "peak_memory_mib")


def _csv(path: Path, measured: bool = True) -> list[dict[str, str]]:
    """The CSV log's rows (``measured=False``: the machine's measurements without their values)."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    return rows if measured else [{**r, "value": "-"} if r["metric"] in _MEASURED else r for r in rows]


def _scalars(log_dir: Path, measured: bool = True) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's scalars by tag (``measured=False``: the machine's measurements without their values)."""
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value if measured or tag not in _MEASURED else 0.0) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}  # fmt: skip


def test_loggers_write_once_from_rank_zero_the_numbers_of_the_history(tmp_path: Path) -> None:
    (history, steps0), (_, steps1) = run_parallel(_logged_run, str(tmp_path), 3, timeout=90)
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1, "one writer"
    rows = _csv(tmp_path / "metrics.csv")
    per_epoch = {(r["metric"], int(r["epoch"])): float(r["value"]) for r in rows if r["metric"] != "train_loss_step"}
    assert per_epoch == {(name, e + 1): v for name, values in history.items() for e, v in enumerate(values)}
    assert len(rows) == len({(r["metric"], r["step"]) for r in rows}), "no value written twice"
    # The step loss is the mean over both ranks' samples of that step, every 5 steps (23 steps per epoch).
    logged = {int(r["step"]): float(r["value"]) for r in rows if r["metric"] == "train_loss_step"}
    assert sorted(logged) == list(range(5, 70, 5))
    for step, value in logged.items():
        total = np.add(steps0[step], steps1[step])
        assert value == pytest.approx(total[0] / total[1], rel=1e-12)
    scalars = _scalars(tmp_path / "tb")
    epoch_ends = sorted(int(r["step"]) for r in rows if r["metric"] == "train_loss")
    for name, values in history.items():
        assert scalars[name] == [(s, float(np.float32(v))) for s, v in zip(epoch_ends, values, strict=True)]
    assert [s for s, _ in scalars["train_loss_step"]] == sorted(logged)


def _early_stopped(patience: int) -> tuple[int, int, int]:
    loop = _loop()
    stopper = EarlyStopping(monitor="train_loss", patience=patience, mode="max")  # a falling loss never improves
    history = loop.fit(10, callbacks=[stopper])
    return len(history["train_loss"]), stopper.stopped_epoch, stopper.best_epoch


def test_early_stopping_stops_every_rank_after_the_same_epoch() -> None:
    assert run_parallel(_early_stopped, 2, timeout=60) == [(3, 3, 1), (3, 3, 1)]


def _best_kept(directory: str) -> tuple[dict[str, list[float]], list[dict[str, torch.Tensor]], str, int]:
    loop, record = _loop(), _Record()
    best = ModelCheckpoint(directory, monitor="validation_loss", mode="min")
    history = loop.fit(4, callbacks=[best, record])
    return history, record.weights, str(best.best_model_path), best.best_epoch


def test_model_checkpoint_keeps_the_weights_of_the_best_epoch(tmp_path: Path) -> None:
    history, weights, path, best_epoch = run_parallel(_best_kept, str(tmp_path), timeout=60)[0]
    losses = history["validation_loss"]
    assert best_epoch == losses.index(min(losses)) + 1
    kept = torch.load(path, weights_only=True)
    assert kept.keys() == weights[0].keys()
    assert all(torch.equal(kept[k], weights[best_epoch - 1][k]) for k in kept)
    assert [p.name for p in tmp_path.iterdir()] == ["best.pt"], "one file, no temporary left"


def _resumable(out: str, stop: int | None) -> dict[str, list[float]]:
    loop = _loop(f"{out}/ckpt", evaluate_every=8)
    callbacks: list[Callback] = [
        TensorBoardLogger(f"{out}/tb", log_every_n_steps=5),
        CSVLogger(f"{out}/metrics.csv", log_every_n_steps=5),
        EarlyStopping(monitor="validation_loss", patience=5),
    ]
    try:
        return loop.fit(3, callbacks=callbacks + ([_StopAt(stop)] if stop else []))
    except KeyboardInterrupt:
        return {}


def test_a_stopped_and_resumed_run_logs_every_epoch_and_step_once(tmp_path: Path) -> None:
    """Stopped after step 35 had been logged, before its checkpoint (so from step 30): the logs equal an
    uninterrupted run's, step 35 logged once; each evaluate_every evaluation logged once, at its step."""
    run_parallel(_resumable, str(tmp_path / "a"), None, timeout=90)
    run_parallel(_resumable, str(tmp_path / "b"), 35, timeout=90)
    stopped = {int(r["step"]) for r in _csv(tmp_path / "b" / "metrics.csv")}
    assert max(stopped) == 35, "the stopped run had logged step 35, which its checkpoint (step 30) does not hold"
    state = load_checkpoint(tmp_path / "b" / "ckpt" / "last.pt")
    assert state["callbacks"]["EarlyStopping-0"]["best_epoch"] == 1, "early stopping's state is checkpointed"
    run_parallel(_resumable, str(tmp_path / "b"), None, timeout=90)
    assert _csv(tmp_path / "b" / "metrics.csv", False) == _csv(tmp_path / "a" / "metrics.csv", False)
    evaluated = [int(r["step"]) for r in _csv(tmp_path / "a" / "metrics.csv") if r["metric"] == "eval_loss"]
    assert evaluated == list(range(8, 3 * 23 + 1, 8)), "every 8th step of 3 epochs of 23 steps, once each"
    epoch_rows = [r for r in _csv(tmp_path / "a" / "metrics.csv") if r["metric"] == "validation_loss"]
    assert len(epoch_rows) == 3, "eval_ numbers are not written again at the epochs' ends"
    assert _scalars(tmp_path / "b" / "tb", False) == _scalars(tmp_path / "a" / "tb", False)
