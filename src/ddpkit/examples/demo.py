"""``ddpkit demo``: a digits classifier trained with DistributedDataParallel on N CPU processes.

What it shows: each rank trains on its shard of the training split (a
:class:`~ddpkit.DistributedSamplerWrapper` around a ``RandomSampler``: the
epochs advance by themselves, no ``set_epoch`` to forget), DDP averages the
gradients, and the validation split is sharded with padding like any
``DistributedSampler`` -- but :func:`~ddpkit.gather_in_order` puts the
predictions back in single-process order with the padded duplicates removed,
so the accuracy printed is exactly the single-process number.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler
from tqdm import tqdm

from ddpkit.examples.digits import digits_datasets
from ddpkit.launch import launch
from ddpkit.ordered import gather_in_order
from ddpkit.process_group import get_rank, is_distributed, seed_everything
from ddpkit.samplers import DistributedSamplerWrapper

__all__ = ["DemoConfig", "DemoResult", "evaluate", "run_demo", "train_digits"]


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
    """

    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"epochs={self.epochs} and batch_size={self.batch_size} must be >= 1 and lr={self.lr} > 0")


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured (identical on every rank).

    Attributes:
        world_size: number of processes that trained.
        train_losses: mean training cross-entropy of each epoch, over all ranks' samples.
        val_correct: validation samples classified correctly after the last epoch.
        val_total: validation samples (each counted exactly once).
        train_seconds: wall time of the training loop on rank 0, in seconds.
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


def train_digits(config: DemoConfig) -> DemoResult:
    """Train and validate on every rank of the current process group (or alone without one).

    Every rank must call it. Rank 0 prints one line per epoch.
    """
    rank = get_rank()
    train_set, val_set = digits_datasets(seed=config.seed)
    seed_everything(config.seed)
    model = build_model()
    ddp_model: nn.Module = DistributedDataParallel(model) if is_distributed() else model
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=config.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    train_sampler = DistributedSamplerWrapper(RandomSampler(train_set), seed=config.seed)
    loader = DataLoader(train_set, batch_size=config.batch_size, sampler=train_sampler)
    val_sampler = DistributedSamplerWrapper(SequentialSampler(val_set))  # padded, as DistributedSampler would
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)

    losses: list[float] = []
    correct = total = 0
    started = time.perf_counter()
    for epoch in range(config.epochs):
        ddp_model.train()
        loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of sample losses, samples)
        bar = tqdm(
            loader,
            desc=f"epoch {epoch + 1}/{config.epochs}",
            unit="batch",
            leave=False,
            disable=not (config.progress and rank == 0),
        )
        for images, labels in bar:
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(images), labels)
            loss.backward()
            optimizer.step()
            loss_sum += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
        correct, total = evaluate(model, val_loader, val_sampler)
        _sum_over_ranks(loss_sum)
        losses.append(float(loss_sum[0] / loss_sum[1]))
        if rank == 0:
            tqdm.write(
                f"epoch {epoch + 1:>2}/{config.epochs}  train loss {losses[-1]:.4f}  "
                f"validation accuracy {correct / total:.4f} ({correct}/{total})"
            )
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    elapsed = time.perf_counter() - started
    return DemoResult(val_sampler.num_replicas, tuple(losses), correct, total, elapsed, weights)


def evaluate(
    model: nn.Module, loader: DataLoader[tuple[torch.Tensor, ...]], sampler: DistributedSamplerWrapper
) -> tuple[int, int]:
    """(correct, total) over the whole validation split, each sample counted exactly once.

    Every rank predicts its (padded) shard; one :func:`~ddpkit.gather_in_order`
    brings ``(prediction, label)`` pairs back in single-process order, duplicates
    removed. Every rank must call it.
    """
    model.eval()
    rows = []
    with torch.no_grad():
        for images, labels in loader:
            rows.append(torch.stack([model(images).argmax(dim=1), labels], dim=1))
    local = torch.cat(rows) if rows else torch.empty(0, 2, dtype=torch.int64)
    pairs = gather_in_order(local, sampler)
    return int((pairs[:, 0] == pairs[:, 1]).sum()), len(pairs)


def run_demo(nprocs: int = 2, config: DemoConfig | None = None) -> DemoResult:
    """Run :func:`train_digits` on ``nprocs`` new CPU processes (gloo on loopback); rank 0's result."""
    results = launch(train_digits, config or DemoConfig(), nprocs=nprocs, backend="gloo")
    result: DemoResult = results[0]
    return result


def _sum_over_ranks(tensor: torch.Tensor) -> None:
    if is_distributed():
        dist.all_reduce(tensor)
