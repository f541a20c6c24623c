"""Callbacks that watch a metric of ``TrainLoop.history``: ``EarlyStopping`` and ``ModelCheckpoint`` (Lightning's).

Both read the metric after each epoch's validation, where it is the whole
split's number and the same on every rank. Their state (the best value, its
epoch, the epochs waited) is saved in ``TrainLoop``'s checkpoints, so a resumed
run goes on deciding as the uninterrupted one would.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Literal

import torch

from ddpkit._compat import override
from ddpkit.callbacks.base import Callback, TrainLoopView
from ddpkit.checkpoint import save_checkpoint
from ddpkit.collectives import sync_ddp
from ddpkit.process_group import get_rank

__all__ = ["EarlyStopping", "ModelCheckpoint"]

Mode = Literal["min", "max"]


class _Monitor(Callback):
    """The best value of one metric so far, and whether the last epoch improved on it."""

    def __init__(self, monitor: str, mode: Mode, min_delta: float = 0.0) -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} must be 'min' or 'max'")
        if min_delta < 0:
            raise ValueError(f"min_delta={min_delta} must be >= 0")
        self.monitor, self.mode, self.min_delta = monitor, mode, min_delta
        self.best_score = math.inf if mode == "min" else -math.inf
        self.best_epoch = 0  # 1-based; 0: none yet

    def _improved(self, train_loop: TrainLoopView) -> bool:
        """Read the metric of the epoch that just ended; record it if it is the best so far."""
        values = train_loop.history.get(self.monitor)
        if not values:
            raise KeyError(
                f"{type(self).__name__} monitors {self.monitor!r}, which the history does not have; it has "
                f"{sorted(train_loop.history)} (validation metrics need a validation_loader)"
            )
        value = float(values[-1])
        better = (
            value < self.best_score - self.min_delta if self.mode == "min" else value > self.best_score + self.min_delta
        )
        if better:
            self.best_score, self.best_epoch = value, train_loop.epoch + 1
        return better

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "best_epoch": self.best_epoch}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score, self.best_epoch = float(state["best_score"]), int(state["best_epoch"])


class EarlyStopping(_Monitor):
    """Stop training when ``monitor`` has not improved for ``patience`` epochs (Lightning's ``EarlyStopping``).

    Rank 0's reading decides, and every rank stops after the same epoch (one
    small all-reduce per epoch); rank 0 prints why. ``TrainLoop.fit`` then
    returns as after its last epoch.

    Args:
        monitor: a name of ``TrainLoop.history`` (default ``"validation_loss"``).
        patience: epochs without improvement before stopping (default 3).
        mode: ``"min"`` (default) or ``"max"``: whether lower or higher is better.
        min_delta: the least change that counts as an improvement (default 0).

    Attributes:
        best_score, best_epoch: the best value so far and its epoch (1-based).
        wait: epochs since the best one. stopped_epoch: the epoch it stopped after (0: it did not).

    Raises:
        ValueError: ``patience < 1``, ``min_delta < 0`` or an unknown ``mode``.
        KeyError: (at the first epoch's end, on every rank) ``monitor`` is not in the history.
    """

    def __init__(
        self, monitor: str = "validation_loss", patience: int = 3, mode: Mode = "min", min_delta: float = 0.0
    ) -> None:
        super().__init__(monitor, mode, min_delta)
        if patience < 1:
            raise ValueError(f"patience={patience} must be >= 1 epochs")
        self.patience = patience
        self.wait = 0
        self.stopped_epoch = 0

    @override
    def on_train_begin(self, train_loop: TrainLoopView) -> None:
        if self.stopped_epoch:  # a resumed run that had stopped: it stays stopped
            train_loop.should_stop = True
            if get_rank() == 0:
                print(
                    f"early stopping had ended this run after epoch {self.stopped_epoch}: nothing to do",
                    file=sys.stderr,
                )

    @override
    def on_epoch_end(self, train_loop: TrainLoopView) -> None:
        self.wait = 0 if self._improved(train_loop) else self.wait + 1
        mine = torch.tensor(float(self.wait >= self.patience) if get_rank() == 0 else 0.0, dtype=torch.float64)
        if float(sync_ddp(mine)) > 0:  # rank 0's decision, on every rank
            self.stopped_epoch = train_loop.epoch + 1
            train_loop.should_stop = True
            if get_rank() == 0:
                print(
                    f"early stopping after epoch {self.stopped_epoch}: {self.monitor} has not improved for "
                    f"{self.wait} epochs (best {self.best_score:.4f} at epoch {self.best_epoch})",
                    file=sys.stderr,
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.wait, self.stopped_epoch = int(state["wait"]), int(state["stopped_epoch"])


class ModelCheckpoint(_Monitor):
    """Keep the weights of the best epoch by ``monitor`` (Lightning's ``ModelCheckpoint`` with ``save_top_k=1``).

    After each epoch that improves on the best so far, rank 0 writes the
    model's ``state_dict`` (CPU tensors, without DDP's ``module.`` prefix) to
    ``dirpath / filename`` atomically; ``torch.load(path, weights_only=True)``
    reads it.

    Args:
        dirpath: the directory (created if missing).
        monitor: a name of ``TrainLoop.history`` (default ``"validation_loss"``).
        mode: ``"min"`` (default) or ``"max"``.
        filename: default ``"best.pt"``.

    Attributes:
        best_model_path: the file. best_score, best_epoch: its metric and epoch (1-based).

    Raises:
        ValueError: an unknown ``mode``.
        KeyError: (at the first epoch's end) ``monitor`` is not in the history.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        monitor: str = "validation_loss",
        mode: Mode = "min",
        filename: str = "best.pt",
    ) -> None:
        super().__init__(monitor, mode)
        self.best_model_path = Path(dirpath) / filename

    @override
    def on_epoch_end(self, train_loop: TrainLoopView) -> None:
        if self._improved(train_loop) and get_rank() == 0:
            weights = {name: tensor.detach().cpu() for name, tensor in train_loop.model.state_dict().items()}
            self.best_model_path.parent.mkdir(parents=True, exist_ok=True)
            save_checkpoint(weights, self.best_model_path)
