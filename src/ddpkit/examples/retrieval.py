"""``ddpkit demo --task retrieval``: metric learning on the digits, in the style of OML (open-metric-learning).

A class-balanced P x K batch sampler (P classes, K samples of each per batch)
is sharded whole batches at a time by :class:`~ddpkit.DistributedSamplerWrapper`
(through :class:`~ddpkit.DDPHandler`); an embedding network is trained with a
triplet loss whose positives and negatives come from every rank's batch
(:func:`~ddpkit.all_gather_ddp_if_available` with ``sync_grads=True``, so the
gradient reaches the rank that computed each embedding); precision@1 over
the validation split is computed on the whole split, in order, on every rank
(:func:`~ddpkit.gather_in_order`), so it is the single-process number.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

from ddpkit.examples.digits import digits_datasets
from ddpkit.jobs.launch import scheduler_environment
from ddpkit.metric_learning import precision_at_1, triplet_loss
from ddpkit.process_group import get_world_size, seed_everything
from ddpkit.training import TrainLoop

__all__ = [
    "BalancedBatchSampler",
    "EmbeddingNet",
    "RetrievalConfig",
    "RetrievalResult",
    "RetrievalTrainLoop",
    "precision_at_1",
    "retrieval_train_loop",
    "run_retrieval_demo",
    "triplet_loss",
]


@dataclass(frozen=True)
class RetrievalConfig:
    """Settings of the retrieval demo.

    Attributes:
        epochs: passes over the training split (default 10).
        classes_per_batch: P, distinct classes in each batch (default 8, at most 10).
        samples_per_class: K, samples of each class in each batch (default 4); a
            batch holds ``P * K`` samples on each rank.
        lr: SGD learning rate (default 0.1, momentum 0.9).
        margin: of the triplet loss, in embedding distance (default 0.5).
        seed: seeds the split, the initial weights and the batches (default 0).
        progress: show a progress bar on rank 0.
    """

    epochs: int = 10
    classes_per_batch: int = 8
    samples_per_class: int = 4
    lr: float = 0.1
    margin: float = 0.5
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or not 2 <= self.classes_per_batch <= 10 or self.samples_per_class < 2:
            raise ValueError(
                f"epochs={self.epochs} must be >= 1, classes_per_batch={self.classes_per_batch} in [2, 10] (the "
                f"digits have 10 classes) and samples_per_class={self.samples_per_class} >= 2"
            )
        if self.lr <= 0 or self.margin <= 0:
            raise ValueError(f"lr={self.lr} and margin={self.margin} must be > 0")


@dataclass(frozen=True)
class RetrievalResult:
    """What the retrieval demo measured.

    Attributes:
        world_size: number of processes that trained.
        train_losses: mean triplet loss of each epoch, over all ranks' anchors.
        precision_at_1: share of validation samples whose nearest other validation
            sample (in embedding distance) has the same class, after the last epoch.
        initial_precision_at_1: the same, before training (the untrained network).
        train_seconds: wall time of the training, in seconds.
        weights: the trained network's ``state_dict``.
    """

    world_size: int
    train_losses: tuple[float, ...]
    precision_at_1: float
    initial_precision_at_1: float
    train_seconds: float
    weights: dict[str, torch.Tensor]


class BalancedBatchSampler(Sampler[list[int]]):
    """Batches of P classes x K samples (OML's balance sampler): each batch draws P distinct classes,
    then K distinct samples of each.

    ``len(labels) // (P * K)`` batches per epoch. The randomness comes from
    ``generator`` (or the global RNG when ``None``), which
    :class:`~ddpkit.DistributedSamplerWrapper` seeds for each epoch from its
    ``seed`` and the epoch: every rank then draws the same epoch and takes its
    own share of the batches.

    Args:
        labels: ``(N,)`` integer class of each sample.
        classes_per_batch: P.
        samples_per_class: K; every class must have at least K samples.
        generator: the source of randomness (default ``None``: the global RNG).

    Raises:
        ValueError: fewer than P classes, a class with fewer than K samples, or
            fewer than ``P * K`` samples in all.
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor,
        classes_per_batch: int,
        samples_per_class: int,
        generator: torch.Generator | None = None,
    ) -> None:
        labels = torch.as_tensor(labels, dtype=torch.int64)
        classes, counts = torch.unique(labels, return_counts=True)
        self.by_class = [torch.nonzero(labels == c).flatten() for c in classes.tolist()]
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.generator = generator
        self.batches = len(labels) // (classes_per_batch * samples_per_class)
        if len(classes) < classes_per_batch or int(counts.min()) < samples_per_class or self.batches < 1:
            raise ValueError(
                f"P x K = {classes_per_batch} x {samples_per_class} needs at least {classes_per_batch} classes "
                f"with {samples_per_class} samples each; the labels have {len(classes)} classes, the smallest with "
                f"{int(counts.min())} samples, {len(labels)} in all"
            )

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.batches):
            classes = torch.randperm(len(self.by_class), generator=self.generator)[: self.classes_per_batch]
            batch: list[int] = []
            for c in classes.tolist():
                members = self.by_class[c]
                chosen = torch.randperm(len(members), generator=self.generator)[: self.samples_per_class]
                batch += members[chosen].tolist()
            yield batch


class EmbeddingNet(nn.Module):
    """64 pixels -> 128 hidden units (ReLU) -> an L2-normalised embedding of ``dim`` (default 32)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``(N, 64)`` images -> ``(N, dim)`` unit vectors."""
        return nn.functional.normalize(self.body(images), dim=1)


class RetrievalTrainLoop(TrainLoop):
    """:class:`~ddpkit.TrainLoop` for metric learning: triplets over all ranks' batches, precision@1."""

    def __init__(self, *args: Any, margin: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.margin = margin

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels = batch
        return triplet_loss(model(images), labels, self.margin)

    def compute_metrics(self, predictions: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """``precision_at_1`` of the whole split's embeddings (``predictions``) and labels."""
        return {"precision_at_1": precision_at_1(predictions, targets)}


def retrieval_train_loop(config: RetrievalConfig) -> RetrievalTrainLoop:
    """The retrieval training, written as single-process code."""
    train_set, val_set = digits_datasets(seed=config.seed)
    seed_everything(config.seed)
    model = EmbeddingNet()
    sampler = BalancedBatchSampler(train_set.tensors[1], config.classes_per_batch, config.samples_per_class)
    return RetrievalTrainLoop(
        model,
        DataLoader(train_set, batch_sampler=sampler),
        DataLoader(val_set, batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9),
        margin=config.margin,
        seed=config.seed,
        progress=config.progress,
    )


def run_retrieval_demo(nprocs: int = 2, config: RetrievalConfig | None = None) -> RetrievalResult:
    """Train on ``nprocs`` new CPU processes (gloo on loopback), or in this process when ``nprocs`` is 0.

    With ``nprocs=0`` the current process group is used if there is one (every rank must call it).
    """
    config = config or RetrievalConfig()
    loop = retrieval_train_loop(config)
    initial = loop.evaluate()["precision_at_1"]
    scheduler = scheduler_environment()
    started = time.perf_counter()
    if nprocs:
        history = loop.fit_distributed(config.epochs, num_processes=nprocs, backend="gloo")
    else:
        history = loop.fit(config.epochs)
    weights = {name: tensor.detach().clone() for name, tensor in loop.model.state_dict().items()}
    return RetrievalResult(
        scheduler.world_size() if nprocs and scheduler is not None else nprocs or get_world_size(),
        tuple(history["train_loss"]),
        history["validation_precision_at_1"][-1],
        initial,
        time.perf_counter() - started,
        weights,
    )
