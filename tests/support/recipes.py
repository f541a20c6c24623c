"""What several test modules share: recipes."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from ddpkit import Callback, TrainLoop
from tests.builders import digits_loop


def _fit(
    batch_size: int, option: str, epochs: int = 2, **kwargs: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[Any]]:
    loop, record = _loop(batch_size, option, **kwargs), _Record()
    loop.fit(epochs, callbacks=[record])
    history = {**loop.history, "lr_after": [loop.recipe.learning_rate(loop.optimizer)]}
    return {k: v.detach().clone() for k, v in loop.model.state_dict().items()}, history, record.steps


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
OPTIONS["fp16-cosine"] = {**OPTIONS["fp16"], **OPTIONS["cosine-per-step"]}


class _Record(Callback):
    """Each step's learning rate and gradient norm as the loop reports them, and the ranks' step count."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.steps.append({"step": train_loop.global_step, **train_loop.step_metrics})


def _loop(batch_size: int, option: str, **kwargs: Any) -> TrainLoop:
    sgd = functools.partial(torch.optim.SGD, lr=0.2, momentum=0.9)
    return digits_loop(batch_size, optimizer=sgd, seed=3, **{**OPTIONS.get(option, {}), **kwargs})
