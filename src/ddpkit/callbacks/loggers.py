"""Metric loggers for ``TrainLoop``: TensorBoard (Lightning's ``TensorBoardLogger``) and a CSV file (``CSVLogger``).

Both write from rank 0 only, each value once: per epoch every number of
``TrainLoop.history`` (``train_loss``, ``validation_<metric>``) as it is there,
each ``evaluate_every`` evaluation's ``eval_<metric>`` at its step, and every
``log_every_n_steps`` optimizer steps the step's training loss, the
mean over every sample of every rank in that step (``train_loss_step``), and
what else the step measured (``lr_step`` with a scheduler, ``grad_norm_step``
with gradient clipping). The step axis is
``global_step`` (optimizer steps). A run resumed from a checkpoint first drops
what was logged after the checkpoint's step, so a killed and restarted run has
no epoch or step twice and none missing.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from ddpkit._compat import override
from ddpkit.callbacks.base import Callback, TrainLoopView
from ddpkit.collectives import sync_ddp
from ddpkit.process_group import get_rank

__all__ = ["CSVLogger", "TensorBoardLogger"]


class _MetricsLogger(Callback):
    """What the loggers share: which numbers, when, and from which rank. Subclasses write them."""

    def __init__(self, log_every_n_steps: int) -> None:
        if log_every_n_steps < 0:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 0 (0: no per-step loss)")
        self.log_every_n_steps = log_every_n_steps
        self._evaluations = 0  # of history's eval_step, those written

    @override
    def on_train_begin(self, train_loop: TrainLoopView) -> None:
        self._evaluations = len(train_loop.history.get("eval_step", ()))  # a resumed run's were written
        if get_rank() == 0:
            self._open(train_loop.global_step)

    def _write_evaluations(self, train_loop: TrainLoopView) -> None:
        """The ``evaluate_every`` evaluations not written yet, each at its step (they run after ``on_batch_end``:
        written at the next event)."""
        steps = train_loop.history.get("eval_step", [])
        names = [name for name in train_loop.history if name.startswith("eval_") and name != "eval_step"]
        for index in range(self._evaluations, len(steps)):
            if get_rank() == 0:
                values = {name: train_loop.history[name][index] for name in names}
                self._write(values, train_loop.epoch + 1, int(steps[index]))
        self._evaluations = len(steps)

    @override
    def on_batch_end(self, train_loop: TrainLoopView) -> None:
        self._write_evaluations(train_loop)
        every = self.log_every_n_steps
        if every and train_loop.global_step % every == 0:
            total, count = sync_ddp(train_loop.step_loss.clone()).tolist()  # every rank: one small all-reduce
            if get_rank() == 0 and count:
                steps = {f"{name}_step": value for name, value in train_loop.step_metrics.items()}  # lr, grad_norm
                self._write({"train_loss_step": total / count, **steps}, train_loop.epoch + 1, train_loop.global_step)

    @override
    def on_epoch_end(self, train_loop: TrainLoopView) -> None:
        self._write_evaluations(train_loop)
        if get_rank() == 0:
            history = train_loop.history
            values = {name: values[-1] for name, values in history.items() if values and not name.startswith("eval_")}
            self._write(values, train_loop.epoch + 1, train_loop.global_step)

    @override
    def on_train_end(self, train_loop: TrainLoopView) -> None:
        self._write_evaluations(train_loop)
        if get_rank() == 0:
            self._close()

    def _open(self, resumed_step: int) -> None:
        """Start writing; a resumed run (``resumed_step`` > 0) first drops what came after that step."""
        raise NotImplementedError

    def _write(self, values: dict[str, float], epoch: int, step: int) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class TensorBoardLogger(_MetricsLogger):
    """Write the training's numbers as TensorBoard scalars (Lightning's ``TensorBoardLogger``).

    Needs ``pip install tensorboard``, ddpkit's ``tensorboard`` extra; view with ``tensorboard
    --logdir LOG_DIR``. Tags are ``history``'s names plus ``train_loss_step``;
    the step is ``global_step``. Values are stored as float32 (TensorBoard's
    format). A resumed run purges what was logged after its checkpoint
    (``SummaryWriter(purge_step=...)``).

    Args:
        log_dir: the directory of the event files (created if missing).
        log_every_n_steps: optimizer steps between two ``train_loss_step``
            values (default 50; 0: none).

    Raises:
        ImportError: tensorboard is not installed (raised on every rank, at construction).
        ValueError: ``log_every_n_steps < 0``.
    """

    def __init__(self, log_dir: str | os.PathLike[str], log_every_n_steps: int = 50) -> None:
        super().__init__(log_every_n_steps)
        try:
            import tensorboard  # type: ignore[import-untyped]  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "TensorBoardLogger needs tensorboard: pip install tensorboard (ddpkit's tensorboard extra)"
            ) from exc
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def __getstate__(self) -> dict[str, Any]:  # travels to fit_distributed's workers before it writes
        return {**self.__dict__, "_writer": None}

    @override
    def _open(self, resumed_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(self.log_dir), purge_step=resumed_step + 1 if resumed_step else None)

    @override
    def _write(self, values: dict[str, float], epoch: int, step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    @override
    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CSVLogger(_MetricsLogger):
    """Write the training's numbers to a CSV file (Lightning's ``CSVLogger``, one value per row).

    Columns ``epoch,step,metric,value``: ``epoch`` 1-based, ``step`` the
    ``global_step``, ``metric`` a name of ``history`` or ``train_loss_step``,
    ``value`` with every digit (``float(value)`` gives ``history``'s number
    back). Each row is flushed as it is written; a resumed run keeps the rows
    up to its checkpoint's step and appends.

    Args:
        path: the CSV file (its directory is created if missing).
        log_every_n_steps: optimizer steps between two ``train_loss_step``
            rows (default 50; 0: none).

    Raises:
        ValueError: ``log_every_n_steps < 0``.
    """

    FIELDS = ("epoch", "step", "metric", "value")

    def __init__(self, path: str | os.PathLike[str], log_every_n_steps: int = 50) -> None:
        super().__init__(log_every_n_steps)
        self.path = Path(path)
        self._file: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "_csv"}, "_file": None}

    @override
    def _open(self, resumed_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict[str, str]] = []
        if resumed_step and self.path.exists():
            with self.path.open(newline="", encoding="utf-8") as handle:
                kept = [row for row in csv.DictReader(handle) if int(row["step"]) <= resumed_step]
        self._file = self.path.open("w", newline="", encoding="utf-8")
        self._csv = csv.DictWriter(self._file, fieldnames=self.FIELDS)
        self._csv.writeheader()
        self._csv.writerows(kept)
        self._file.flush()

    @override
    def _write(self, values: dict[str, float], epoch: int, step: int) -> None:
        for name, value in values.items():
            self._csv.writerow({"epoch": epoch, "step": step, "metric": name, "value": repr(float(value))})
        self._file.flush()

    @override
    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
