"""TrainLoop's training recipes: learning-rate schedules, mixed precision, gradient clipping, torch.compile.

Each on 2 ranks against one process with the doubled batch (DDP must still
equal one process), across a mid-epoch resume (bit-identical with the
scheduler's and the scaler's state), across a resize with a global batch (the
learning rate of every step as unresized), and fp16's skipped steps on every
rank alike.

Here, the tests that need no process; the others are in tests/ranks/test_recipes.py and tests/e2e/test_recipes.py.
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit import Callback, CSVLogger, TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ddpkit.examples.digits import digits_datasets
from tests.builders import digits_loop, digits_model

# --- run in the workers (top level: pickled by reference) -----------------------------------


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over ``warmup`` steps, then cosine to 0 at ``total`` (what most recipes use)."""

    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup_cosine_factor, warmup, total))


def _warmup_cosine_factor(warmup: int, total: int, step: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _plateau(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.ReduceLROnPlateau:
    """Halves the learning rate when validation accuracy does not fall (it rises: a test of the metric it gets)."""
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)


#: TrainLoop arguments by name (built in the worker: schedulers are made on its optimizer).
OPTIONS: dict[str, dict[str, Any]] = {
    "cosine-per-step": {
        "lr_scheduler": functools.partial(warmup_cosine, warmup=5, total=40),
        "lr_scheduler_interval": "step",
    },
    "step-per-epoch": {"lr_scheduler": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5)},
    "plateau": {"lr_scheduler": _plateau, "lr_scheduler_monitor": "validation_accuracy"},  # halves after epoch 2
    "clip-norm": {"gradient_clip_norm": 0.3},
    "clip-value": {"gradient_clip_val": 0.005},
    "bf16": {"precision": "bf16-mixed"},
    "fp16": {"precision": "16-mixed"},
    "compile": {"compile": {"backend": "aot_eager"}},
}
#: fp16 with a global batch of 4 batches per step on one process, 2 on each of 2 ranks: the gradients are unscaled
#: and clipped after the last micro-batch only.
OPTIONS["fp16-clip-accumulated"] = {"precision": "16-mixed", "gradient_clip_norm": 0.3, "global_batch_size": 128}
OPTIONS["all"] = {**OPTIONS["cosine-per-step"], **OPTIONS["clip-norm"], **OPTIONS["bf16"], **OPTIONS["compile"]}


class _Record(Callback):
    """Each step's learning rate and gradient norm as the loop reports them, and the ranks' step count."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.steps.append({"step": train_loop.global_step, **train_loop.step_metrics})


def _loop(batch_size: int, option: str, **kwargs: Any) -> TrainLoop:
    sgd = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)
    return digits_loop(batch_size, optimizer=sgd, seed=3, **{**OPTIONS.get(option, {}), **kwargs})


# --- resume and resize ------------------------------------------------------------------------------


OPTIONS["fp16-cosine"] = {**OPTIONS["fp16"], **OPTIONS["cosine-per-step"]}


# --- compile: checkpoints hold the plain model's keys --------------------------------------------------


def test_a_compiled_model_checkpoints_the_plain_models_keys(tmp_path: Path) -> None:
    loop = _loop(64, "compile", checkpoint_dir=tmp_path)
    loop.fit(1)
    saved = load_checkpoint(tmp_path / CHECKPOINT_FILE)
    assert sorted(saved["model"]) == sorted(digits_model().state_dict())


# --- arguments ------------------------------------------------------------------------------------------


def test_bad_recipe_arguments_are_refused_naming_them(monkeypatch: pytest.MonkeyPatch) -> None:
    train, _ = digits_datasets(seed=0)
    model = digits_model()
    loader = DataLoader(train, batch_size=64)
    with pytest.raises(ValueError, match=r"precision='fp16': use one of '32', 'bf16-mixed', '16-mixed'"):
        TrainLoop(model, loader, precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"gradient_clip_norm=1.0 and gradient_clip_val=0.5: pass one"):
        TrainLoop(model, loader, gradient_clip_norm=1.0, gradient_clip_val=0.5)
    with pytest.raises(ValueError, match=r"gradient_clip_norm=-1 must be a finite number > 0"):
        TrainLoop(model, loader, gradient_clip_norm=-1)
    with pytest.raises(ValueError, match=r"lr_scheduler_interval='batch': use 'step' or 'epoch'"):
        TrainLoop(model, loader, lr_scheduler_interval="batch")  # type: ignore[arg-type]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    with pytest.raises(ValueError, match=r"ReduceLROnPlateau .* use lr_scheduler_interval='epoch'"):
        TrainLoop(model, loader, optimizer=optimizer, lr_scheduler=plateau, lr_scheduler_interval="step")
    other = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.raises(ValueError, match=r"lr_scheduler is on another optimizer than the TrainLoop's"):
        TrainLoop(model, loader, optimizer=optimizer, lr_scheduler=other, progress=False).fit(1)
    with pytest.raises(KeyError, match=r"ReduceLROnPlateau monitors 'validation_loss'.*has \['lr', 'train_loss'\]"):
        TrainLoop(model, loader, optimizer=optimizer, lr_scheduler=plateau, progress=False).fit(1)
    with pytest.raises(RuntimeError, match=r"torch.compile has no backend 'nope'; it has .*aot_eager"):
        TrainLoop(model, loader, compile={"backend": "nope"}, progress=False).fit(1)
    monkeypatch.setenv("CXX", "/no/such/g++")
    with pytest.raises(RuntimeError, match=r"inductor needs a C\+\+ compiler on CPU and found no '/no/such/g\+\+'"):
        TrainLoop(model, loader, compile=True, progress=False).fit(1)


# --- through fit_distributed: the callable scheduler is built in each worker -----------------------------


def test_the_loggers_write_each_steps_learning_rate_and_gradient_norm(tmp_path: Path) -> None:
    loop, record = _loop(64, "all", compile=False), _Record()
    loop.fit(1, callbacks=[record, CSVLogger(tmp_path / "metrics.csv", log_every_n_steps=1)])
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    for name in ("lr", "grad_norm"):
        logged = [float(row["value"]) for row in rows if row["metric"] == f"{name}_step"]
        assert logged == [step[name] for step in record.steps], name
    assert [float(row["value"]) for row in rows if row["metric"] == "lr"] == loop.history["lr"]
