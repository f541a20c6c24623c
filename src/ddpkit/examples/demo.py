"""``ddpkit demo``: a digits classifier trained with DDP on N CPU processes, through :class:`~ddpkit.TrainLoop`.

The training code is plain single-process PyTorch (a model, two DataLoaders, an
optimizer); ``TrainLoop.fit_distributed`` turns it into DDP. Each rank trains on
its shard of the training split (epochs advance by themselves, no
``set_epoch`` to forget), DDP averages the gradients, and the validation split
is evaluated on every sample exactly once (:func:`~ddpkit.gather_in_order`): the
accuracy printed is the single-process number.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR
from torch.utils.data import DataLoader

from ddpkit.callbacks import Callback, CSVLogger, TensorBoardLogger
from ddpkit.examples.digits import digits_datasets
from ddpkit.jobs.launch import scheduler_environment
from ddpkit.process_group import (
    destroy_dist_connection,
    get_rank,
    get_world_size,
    init_dist_connection,
    seed_everything,
)
from ddpkit.training import Precision, TrainLoop

__all__ = [
    "DemoConfig",
    "DemoResult",
    "build_model",
    "digits_train_loop",
    "main",
    "run_demo",
    "train_digits",
    "weights_digest",
]


@dataclass(frozen=True)
class DemoConfig:
    """Settings of the demo run.

    Attributes:
        epochs: passes over the training split (default 10).
        batch_size: samples per step on each process (default 32; the global
            batch is ``batch_size * world_size``).
        lr: SGD learning rate (default 0.1, momentum 0.9).
        seed: seeds the split, the initial weights and the shuffling (default 0).
        progress: show a progress bar on rank 0.
        logdir: if set, TensorBoard logs, ``metrics.csv`` and ``history.png``
            (the curves) go to this directory.
        lr_schedule: ``"none"`` (default) or ``"cosine"``: the learning rate
            falls from ``lr`` to 0 along a cosine over the epochs
            (``CosineAnnealingLR``, stepped after each epoch).
        precision: ``"32"`` (default), ``"bf16-mixed"`` or ``"16-mixed"`` (``TrainLoop``'s).
        clip: clip the gradients' norm to this at each optimizer step (default ``None``: no clipping).
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0
    progress: bool = True
    logdir: str | None = None
    lr_schedule: str = "none"
    precision: Precision = "32"
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"epochs={self.epochs} and batch_size={self.batch_size} must be >= 1 and lr={self.lr} > 0")
        if self.lr_schedule not in ("none", "cosine"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r}: use 'none' or 'cosine'")
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"clip={self.clip} must be > 0 (the largest gradient norm), or None")


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured.

    Attributes:
        world_size: number of processes that trained.
        train_losses: mean training cross-entropy of each epoch, over all ranks' samples.
        val_correct: validation samples classified correctly after the last epoch.
        val_total: validation samples (each counted exactly once).
        train_seconds: wall time of the training, in seconds.
        weights: the trained model's ``state_dict`` (to check the accuracy on one process).
    """

    world_size: int
    train_losses: tuple[float, ...]
    val_correct: int
    val_total: int
    train_seconds: float
    weights: dict[str, torch.Tensor]

    @property
    def val_accuracy(self) -> float:
        """``val_correct / val_total``."""
        return self.val_correct / self.val_total


def build_model() -> nn.Module:
    """The classifier: 64 pixels -> 128 hidden units (ReLU) -> 10 classes."""
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def digits_train_loop(config: DemoConfig, checkpoint_dir: str | Path | None = None) -> TrainLoop:
    """The demo's training, written as single-process code: model, loaders, SGD, cross-entropy."""
    train_set, val_set = digits_datasets(seed=config.seed)
    seed_everything(config.seed)
    model = build_model()
    # A callable, so that each worker of fit_distributed builds it on its own optimizer.
    schedule = functools.partial(CosineAnnealingLR, T_max=config.epochs) if config.lr_schedule == "cosine" else None
    return TrainLoop(
        model,
        DataLoader(train_set, batch_size=config.batch_size, shuffle=True),
        DataLoader(val_set, batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9),
        criterion=nn.CrossEntropyLoss(),
        seed=config.seed,
        progress=config.progress,
        checkpoint_dir=checkpoint_dir,
        lr_scheduler=schedule,
        precision=config.precision,
        gradient_clip_norm=config.clip,
    )


def train_digits(config: DemoConfig) -> DemoResult:
    """Train on every rank of the current process group (or alone without one); every rank must call it."""
    loop = digits_train_loop(config)
    started = time.perf_counter()
    history = loop.fit(config.epochs)
    return _result(loop, history, get_world_size(), time.perf_counter() - started)


def run_demo(nprocs: int = 2, config: DemoConfig | None = None) -> DemoResult:
    """Train on ``nprocs`` new CPU processes (gloo on loopback) with ``TrainLoop.fit_distributed``.

    Under a scheduler that started the job's processes (``srun``, ``mpirun``),
    this process trains as one of them instead (every task must call it).
    """
    config = config or DemoConfig()
    loop = digits_train_loop(config)
    scheduler = scheduler_environment()
    started = time.perf_counter()
    callbacks: list[Callback] | None = None
    if config.logdir is not None:
        callbacks = [TensorBoardLogger(config.logdir, 10), CSVLogger(Path(config.logdir) / "metrics.csv", 10)]
    history = loop.fit_distributed(config.epochs, num_processes=nprocs, callbacks=callbacks, backend="gloo")
    if config.logdir is not None and (scheduler is None or scheduler.global_rank() == 0):
        loop.plot_history(Path(config.logdir) / "history.png")
    world_size = scheduler.world_size() if scheduler is not None else nprocs
    return _result(loop, history, world_size, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> None:
    """``python -m ddpkit.examples.demo``: train on the ranks of the job this process belongs to.

    For ``ddpkit run -m ddpkit.examples.demo``, ``srun`` or ``mpirun``: every
    process trains as one rank (:func:`~ddpkit.init_dist_connection` reads the
    environment); rank 0 prints the summary and, with ``--out FILE``, writes it
    as JSON with a sha256 of the trained weights.
    """
    parser = argparse.ArgumentParser(prog="python -m ddpkit.examples.demo", description=main.__doc__)
    parser.add_argument("--epochs", type=int, default=DemoConfig.epochs)
    parser.add_argument("--batch-size", type=int, default=DemoConfig.batch_size)
    parser.add_argument("--seed", type=int, default=DemoConfig.seed)
    parser.add_argument("--out", type=Path, default=None, help="write rank 0's summary here (JSON)")
    args = parser.parse_args(argv)
    config = DemoConfig(args.epochs, args.batch_size, seed=args.seed, progress=False)
    init_dist_connection(None, "gloo")
    try:
        result = train_digits(config)
        rank = get_rank()
    finally:
        destroy_dist_connection()
    if rank != 0:
        return
    summary = {
        "world_size": result.world_size,
        "train_losses": list(result.train_losses),
        "val_correct": result.val_correct,
        "weights_sha256": weights_digest(result.weights),
    }
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps(summary))


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 over the names and bytes of a ``state_dict``: equal exactly when the weights are bit-identical."""
    digest = hashlib.sha256()
    for name, tensor in weights.items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _result(loop: TrainLoop, history: dict[str, list[float]], world_size: int, seconds: float) -> DemoResult:
    assert loop.validation_loader is not None
    total = len(loop.validation_loader.dataset)  # type: ignore[arg-type]
    correct = round(history["validation_accuracy"][-1] * total)
    weights = {name: tensor.detach().clone() for name, tensor in loop.model.state_dict().items()}
    return DemoResult(world_size, tuple(history["train_loss"]), correct, total, seconds, weights)


if __name__ == "__main__":
    main()
