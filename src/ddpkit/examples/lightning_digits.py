"""Lightning on the digits with DDP on CPU processes: OML's ``ExtractorModuleDDP`` and ``PairwiseModuleDDP``.

Needs ``pip install lightning``, ddpkit's ``lightning`` extra. Run with 2 CPU processes::

    python -m ddpkit.examples.lightning_digits extractor
    python -m ddpkit.examples.lightning_digits pairwise

Each builds its module with its loaders (a class-balanced P x K batch sampler
for training), a ``Trainer(accelerator="cpu", devices=N, strategy="ddp",
use_distributed_sampler=False)``, and trains on N processes started by
:func:`~ddpkit.launch` (or on the scheduler's tasks under ``srun``/``mpirun``).
Rank 0 prints the validation metrics, which equal a single-process evaluation
of the trained weights.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import BalancedBatchSampler, EmbeddingNet
from ddpkit.integrations.lightning import ExtractorModuleDDP, PairwiseModuleDDP, PairwiseScorer
from ddpkit.jobs.launch import launch, scheduler_environment
from ddpkit.process_group import is_distributed, seed_everything

__all__ = ["LightningDigitsConfig", "Task", "digits_module", "digits_trainer", "main", "train_digits"]

Task = Literal["extractor", "pairwise"]


@dataclass(frozen=True)
class LightningDigitsConfig:
    """Settings of the Lightning digits examples.

    Attributes:
        epochs: passes over the training split (default 5).
        classes_per_batch: P of the P x K batches (default 8).
        samples_per_class: K of the P x K batches (default 4).
        lr: learning rate (SGD with momentum 0.9 for the extractor, Adam for the pairwise model).
        top_n: candidates the pairwise model re-scores per query (default 5).
        seed: seeds the split, the initial weights and the batches (default 0).
        val_batch_size: of the validation loader (default 64).
    """

    epochs: int = 5
    classes_per_batch: int = 8
    samples_per_class: int = 4
    lr: float = 0.1
    top_n: int = 5
    seed: int = 0
    val_batch_size: int = 64


def digits_module(task: Task, config: LightningDigitsConfig) -> ExtractorModuleDDP | PairwiseModuleDDP:
    """The module of ``task``, holding its digits loaders; the same on every rank for the same ``config``.

    ``"extractor"``: an :class:`~ddpkit.examples.retrieval.EmbeddingNet` trained
    with the cross-rank triplet loss. ``"pairwise"``: a
    :class:`~ddpkit.integrations.lightning.PairwiseScorer` re-ranking the
    nearest neighbours of the raw pixels (the pixels are the embeddings).

    Raises:
        ValueError: an unknown ``task``.
    """
    train_set, val_set = digits_datasets(seed=config.seed)
    seed_everything(config.seed)
    sampler = BalancedBatchSampler(train_set.tensors[1], config.classes_per_batch, config.samples_per_class)
    train_loader = DataLoader(train_set, batch_sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=config.val_batch_size)
    if task == "extractor":
        extractor = EmbeddingNet()
        optimizer = torch.optim.SGD(extractor.parameters(), lr=config.lr, momentum=0.9)
        return ExtractorModuleDDP(train_loader, val_loader, extractor=extractor, optimizer=optimizer)
    if task == "pairwise":
        scorer = PairwiseScorer(dim=64)
        optimizer_ = torch.optim.Adam(scorer.parameters(), lr=config.lr / 10)
        return PairwiseModuleDDP(
            train_loader, val_loader, pairwise_model=scorer, optimizer=optimizer_, top_n=config.top_n
        )
    raise ValueError(f"task={task!r} must be 'extractor' or 'pairwise'")


def digits_trainer(devices: int, epochs: int, **kwargs: Any) -> pl.Trainer:
    """A quiet CPU ``Trainer``: ``strategy="ddp"`` with ``use_distributed_sampler=False`` for ``devices`` > 1
    or inside a process group.

    No logger, checkpoints, progress bar, model summary or sanity check;
    ``kwargs`` override any ``Trainer`` argument.
    """
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        # DDP also for one process inside a process group (`-n 1`), so that Lightning syncs what it logs.
        "strategy": "ddp" if devices > 1 or is_distributed() else "auto",
        "use_distributed_sampler": False,
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**options, **kwargs})


def train_digits(task: Task, config: LightningDigitsConfig, devices: int) -> dict[str, float]:
    """Build and fit ``task``'s module on ``devices`` processes (call it on every rank); its last validation metrics."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        # Our loaders read in-memory tensors: worker processes would only add start-up time.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Lightning 2.6 calls a torch.utils._pytree API that torch 2.13 deprecates; not ours to fix.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
        module = digits_module(task, config)
        digits_trainer(devices, config.epochs).fit(module)
    return dict(module.validation_metrics)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m ddpkit.examples.lightning_digits {extractor,pairwise} [--nprocs N] [--epochs E] [--seed S]``."""
    parser = argparse.ArgumentParser(prog="python -m ddpkit.examples.lightning_digits", description=__doc__)
    parser.add_argument("task", choices=["extractor", "pairwise"])
    parser.add_argument("-n", "--nprocs", type=int, default=2, help="CPU processes (default 2)")
    parser.add_argument("--epochs", type=int, default=LightningDigitsConfig.epochs)
    parser.add_argument("--seed", type=int, default=LightningDigitsConfig.seed)
    args = parser.parse_args(argv)
    config = replace(LightningDigitsConfig(), epochs=args.epochs, seed=args.seed)
    scheduler = scheduler_environment()
    devices = scheduler.world_size() if scheduler is not None else args.nprocs
    started = time.perf_counter()
    results = launch(train_digits, args.task, config, devices, nprocs=args.nprocs, backend="gloo")
    if 0 in results:  # rank 0 of this node (under a scheduler: only the task with rank 0)
        metrics = "  ".join(f"{name} {value:.4f}" for name, value in sorted(results[0].items()))
        print(
            f"lightning {args.task}: {devices} process{'es' if devices != 1 else ''} (gloo), {config.epochs} epochs, "
            f"{time.perf_counter() - started:.1f} s; {metrics}"
        )


if __name__ == "__main__":
    main()
