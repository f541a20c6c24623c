"""What the epoch runner reads of the loop that owns it (private)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.callbacks import CallbacksHandler
from ddpkit.ddp_handler import DDPHandler
from ddpkit.parallel_plugin import ParallelPlugin
from ddpkit.training._preemption import PreemptionHandler
from ddpkit.training._recipe import Recipe
from ddpkit.training._state import RunState
from ddpkit.training._steps import GlobalBatch

__all__ = ["Trains"]


class Trains(Protocol):
    """What a :class:`~ddpkit.training._run.TrainingRun` reads from the loop that owns it (``TrainLoop``): the user's
    parts and steps. The run writes back only what its set-up makes (``ddp_handler``, ``ddp_model``) and
    ``step_times``."""

    model: nn.Module
    train_loader: DataLoader[Any]
    validation_loader: DataLoader[Any] | None
    optimizer: torch.optim.Optimizer
    device: torch.device
    plugin: ParallelPlugin
    checkpoint_dir: Path | None
    checkpoint_every: int | None
    checkpoint_async: bool
    evaluate_every: int | None
    seed: int
    progress: bool
    global_batch: GlobalBatch | None
    preemption: PreemptionHandler
    callbacks_handler: CallbacksHandler
    state: RunState
    ddp_handler: DDPHandler | None
    ddp_model: nn.Module | None
    step_times: list[float]
    recipe: Recipe
    tokens_fn: Callable[[Any], int | torch.Tensor] | None

    def batch_to_device(self, batch: Any) -> Any: ...

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def evaluate(self, loader: DataLoader[Any] | None = None) -> dict[str, float]: ...
