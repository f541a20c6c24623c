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
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit import CSVLogger, TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ddpkit.examples.digits import digits_datasets
from tests.builders import digits_model
from tests.support.recipes import _loop, _Record

# --- run in the workers (top level: pickled by reference) -----------------------------------


# --- resume and resize ------------------------------------------------------------------------------


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
    has = r"has \['items_per_second', 'lr', 'peak_memory_mib', 'train_loss'\]"
    with pytest.raises(KeyError, match=rf"ReduceLROnPlateau monitors 'validation_loss'.*{has}"):
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
