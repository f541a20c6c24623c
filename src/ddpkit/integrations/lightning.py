"""Lightning modules whose loaders are sharded by ddpkit (layer 7; seed 001, OML's ``ddp`` section).

``ModuleDDP`` holds its loaders and hands them to the ``Trainer`` patched with
:func:`~ddpkit.patch_dataloader_to_ddp`, so custom samplers and batch samplers
work under ``Trainer(strategy="ddp", use_distributed_sampler=False)``: each
rank gets its own share of every epoch, instead of Lightning replacing a custom
sampler or every rank seeing everything. ``ExtractorModuleDDP`` trains an
embedding extractor (negatives from every rank) and ``PairwiseModuleDDP`` a
pairwise re-ranker; both report precision@1 over the whole validation split,
equal to a single-process evaluation of the same weights.

Needs the optional extra: ``pip install 'ddpkit[lightning]'`` (Lightning 2.x).
The rest of ddpkit never imports Lightning.

Example::

    model = ExtractorModuleDDP(extractor, criterion=None, optimizer=optimizer,
                               loaders_train=train_loader, loaders_val=val_loader)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
                      use_distributed_sampler=False, max_epochs=5)
    trainer.fit(model)          # no loaders here: the module holds them
    model.validation_metrics    # {"precision_at_1": ...}, the same on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

try:
    import lightning.pytorch as pl
except ModuleNotFoundError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ModuleNotFoundError(
        "ddpkit.integrations.lightning needs Lightning 2.x, which is not installed: pip install 'ddpkit[lightning]'",
        name=exc.name,
    ) from exc

from ddpkit.collectives import sync_ddp
from ddpkit.loaders import patch_dataloader_to_ddp
from ddpkit.metric_learning import distances, precision_at_1, triplet_loss
from ddpkit.ordered import gather_in_order
from ddpkit.process_group import get_rank, get_world_size, is_distributed

__all__ = ["ExtractorModuleDDP", "ModuleDDP", "PairwiseModuleDDP", "PairwiseScorer"]

Loaders = DataLoader[Any] | Sequence[DataLoader[Any]]
#: ``criterion(embeddings (B, D), labels (B,)) -> scalar loss``.
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ModuleDDP(pl.LightningModule):
    """A ``LightningModule`` that holds its loaders and shards them for DDP (seed 001, OML).

    ``train_dataloader`` and ``val_dataloader`` return the given loader, or
    list of loaders, each patched with :func:`~ddpkit.patch_dataloader_to_ddp`:
    its sampler or batch sampler (custom ones included) is wrapped by
    :class:`~ddpkit.DDPSamplerWrapper`, so each rank gets its share of every
    epoch. Give the loaders here, not to ``trainer.fit``, and create the trainer
    with ``use_distributed_sampler=False`` so that Lightning keeps them. In one
    process the loaders are returned unchanged.

    Args:
        loaders_train: the training loader, or a list or tuple of them.
        loaders_val: the validation loader, or a list or tuple of them.

    Raises:
        ValueError: neither ``loaders_train`` nor ``loaders_val`` is given; or
            ``trainer.fit`` asks for the training loader of a module made without one.
        TypeError: a loader is not a ``DataLoader``.
    """

    def __init__(self, loaders_train: Loaders | None = None, loaders_val: Loaders | None = None) -> None:
        if loaders_train is None and loaders_val is None:
            raise ValueError(
                f"{type(self).__name__} needs its loaders: pass loaders_train=... (for trainer.fit) and/or "
                "loaders_val=... (for validation); both are None"
            )
        super().__init__()
        _check_loaders(loaders_train, "loaders_train")
        _check_loaders(loaders_val, "loaders_val")
        self.loaders_train = loaders_train
        self.loaders_val = loaders_val
        #: The patched validation loaders of the running epoch, in ``dataloader_idx`` order.
        self.patched_val_loaders: list[DataLoader[Any]] = []

    def train_dataloader(self) -> Any:
        """``loaders_train``, patched for DDP (called by the ``Trainer``)."""
        if self.loaders_train is None:
            raise ValueError(
                f"{type(self).__name__} was created with loaders_train=None, so it cannot be trained: pass "
                "loaders_train=... when creating it (give loaders to the module, not to trainer.fit)"
            )
        patched = _patched(self.loaders_train)
        return patched[0] if isinstance(self.loaders_train, DataLoader) else patched

    def val_dataloader(self) -> Any:
        """``loaders_val``, patched for DDP (called by the ``Trainer``); no validation when ``None``."""
        if self.loaders_val is None:
            self.patched_val_loaders = []
            return []
        self.patched_val_loaders = _patched(self.loaders_val)
        return self.patched_val_loaders[0] if isinstance(self.loaders_val, DataLoader) else self.patched_val_loaders


class _RetrievalValidation(ModuleDDP):
    """Collects validation embeddings and labels per loader; subclasses turn the whole split into metrics."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        loaders_train: Loaders | None,
        loaders_val: Loaders | None,
        input_tensors_key: str,
        labels_key: str,
    ) -> None:
        super().__init__(loaders_train, loaders_val)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.input_tensors_key = input_tensors_key
        self.labels_key = labels_key
        #: The metrics of the last full validation, as exact Python floats (the same on every rank).
        self.validation_metrics: dict[str, float] = {}
        self._collected: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def configure_optimizers(self) -> Any:
        """The optimizer, with its scheduler (stepped every epoch) when one was given."""
        if self.scheduler is None:
            return self.optimizer
        return {"optimizer": self.optimizer, "lr_scheduler": self.scheduler}

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` inputs -> ``(B, D)`` embeddings."""
        raise NotImplementedError

    def unpack(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of a batch: a mapping (``input_tensors_key``, ``labels_key``) or a sequence
        whose first two items they are (further items are ignored).

        Raises:
            TypeError: any other batch.
        """
        if isinstance(batch, Mapping):
            return batch[self.input_tensors_key], batch[self.labels_key]
        if isinstance(batch, (list, tuple)) and len(batch) >= 2:
            return batch[0], batch[1]
        raise TypeError(
            f"{type(self).__name__} expects batches that are a dict with keys {self.input_tensors_key!r} and "
            f"{self.labels_key!r}, or (inputs, labels, ...) sequences; got {type(batch).__name__}. Override "
            "unpack() for other batches"
        )

    def on_validation_epoch_start(self) -> None:
        self._collected = {}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        inputs, labels = self.unpack(batch)
        self._collected.setdefault(dataloader_idx, []).append((self.embed(inputs).detach(), labels.detach()))

    def on_validation_epoch_end(self) -> None:
        collected, self._collected = self._collected, {}
        if self.trainer.sanity_checking:  # a few batches only: not the split, so no metric
            return
        metrics: dict[str, float] = {}
        for idx, loader in enumerate(self.patched_val_loaders):
            parts = collected.get(idx, [])
            local_embeddings = torch.cat([e for e, _ in parts]) if parts else torch.empty(0, 0)
            local_labels = torch.cat([y for _, y in parts]) if parts else torch.empty(0, dtype=torch.int64)
            embeddings, labels = local_embeddings, local_labels
            if is_distributed():  # every rank gets the whole split in single-process order, duplicates removed
                embeddings = gather_in_order(local_embeddings, loader)
                labels = gather_in_order(local_labels, loader)
            suffix = "" if len(self.patched_val_loaders) == 1 else f"/{idx}"
            for name, value in self.split_metrics(embeddings, labels).items():
                metrics[name + suffix] = value
        self.validation_metrics = metrics
        for name, value in metrics.items():
            # Identical on every rank already, so their mean (sync_dist) is the value itself.
            self.log(name, value, sync_dist=True)

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """Metrics of a whole validation split: ``(N, D)`` embeddings and ``(N,)`` labels, on every rank."""
        raise NotImplementedError


class ExtractorModuleDDP(_RetrievalValidation):
    """Train an embedding extractor under DDP; log retrieval precision@1 of the whole validation split (seed 001).

    Training: ``criterion(extractor(inputs), labels)``; the default criterion is
    :func:`~ddpkit.metric_learning.triplet_loss` with margin 0.5, whose positives
    and negatives come from every rank's batch through
    :func:`~ddpkit.all_gather_ddp_if_available` with ``sync_grads=True`` (so
    every rank's batch must have the same size: use a batch sampler such as a
    P x K sampler). Validation: the embeddings of the split, gathered in
    single-process order with :func:`~ddpkit.gather_in_order`, give
    ``precision_at_1`` (the share of samples whose nearest other sample has
    their label), logged and kept in :attr:`validation_metrics`; it equals a
    single-process evaluation of the same weights exactly.

    Batches are dicts with ``input_tensors_key`` and ``labels_key`` (OML's
    defaults) or ``(inputs, labels, ...)`` sequences.

    Args:
        extractor: ``(B, ...)`` inputs -> ``(B, D)`` embeddings.
        criterion: ``criterion(embeddings, labels) -> loss``; ``None``: the cross-rank triplet loss.
        optimizer: over ``extractor``'s parameters.
        loaders_train, loaders_val: as in :class:`ModuleDDP`.
        scheduler: an optional learning-rate scheduler of ``optimizer``, stepped every epoch.
        input_tensors_key, labels_key: the batch keys of dict batches.

    Raises:
        ValueError, TypeError: as :class:`ModuleDDP`.
    """

    def __init__(
        self,
        extractor: nn.Module,
        criterion: Criterion | None,
        optimizer: torch.optim.Optimizer,
        loaders_train: Loaders | None = None,
        loaders_val: Loaders | None = None,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        input_tensors_key: str = "input_tensors",
        labels_key: str = "labels",
    ) -> None:
        super().__init__(optimizer, scheduler, loaders_train, loaders_val, input_tensors_key, labels_key)
        self.extractor = extractor
        self.criterion: Criterion = criterion if criterion is not None else _default_triplet_loss

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.extractor(inputs)  # type: ignore[no-any-return]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` inputs -> ``(B, D)`` embeddings."""
        return self.embed(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self.unpack(batch)
        loss = self.criterion(self.extractor(inputs), labels)
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels))
        return loss

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        return {"precision_at_1": precision_at_1(embeddings, labels)}


class PairwiseScorer(nn.Module):
    """A pairwise model for :class:`PairwiseModuleDDP`: ``(N, D)`` and ``(N, D)`` embeddings -> ``(N,)`` logits
    that the two are of the same class, from ``[|a - b|, a * b]`` through an MLP (``hidden`` units, default 64).
    """

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([(a - b).abs(), a * b], dim=-1)).squeeze(-1)  # type: ignore[no-any-return]


class PairwiseModuleDDP(_RetrievalValidation):
    """Train a pairwise re-ranker under DDP; report precision@1 before and after re-ranking (seed 001).

    A pairwise model scores a pair of embeddings: ``pairwise_model(a, b)``, with
    ``a`` and ``b`` of shape ``(N, D)``, returns ``(N,)`` logits that the two
    are of the same class. Embeddings are ``extractor(inputs)``, computed
    without gradients (the extractor is frozen: ``requires_grad`` off, eval
    mode); with ``extractor=None`` the inputs are the embeddings already.

    Training: every pair of distinct samples of this rank's batch, with the
    binary cross-entropy of its logit, positives and negatives weighted equally
    (the mean over positive pairs plus the mean over negative pairs, halved);
    DDP averages the gradients over ranks.

    Validation, over the whole split (gathered in single-process order with
    :func:`~ddpkit.gather_in_order`): each sample is a query against all the
    others; its ``top_n`` nearest candidates (Euclidean distance) are re-scored
    by the pairwise model and re-ordered by score. The queries are shared out
    over the ranks and the counts of correct top-1 answers summed with
    :func:`~ddpkit.sync_ddp`, so ``precision_at_1_before`` (nearest candidate)
    and ``precision_at_1_after`` (best-scored candidate) equal a single-process
    evaluation exactly. Both are logged and kept in :attr:`validation_metrics`.

    Args:
        pairwise_model: ``(a, b) -> logits``, e.g. :class:`PairwiseScorer`.
        optimizer: over ``pairwise_model``'s parameters.
        extractor: ``(B, ...)`` inputs -> ``(B, D)`` embeddings, frozen; ``None``: identity.
        loaders_train, loaders_val: as in :class:`ModuleDDP`.
        top_n: candidates re-scored per query (default 5, >= 1).
        scheduler, input_tensors_key, labels_key: as in :class:`ExtractorModuleDDP`.

    Raises:
        ValueError: ``top_n`` < 1; and as :class:`ModuleDDP`.
    """

    def __init__(
        self,
        pairwise_model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extractor: nn.Module | None = None,
        loaders_train: Loaders | None = None,
        loaders_val: Loaders | None = None,
        top_n: int = 5,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        input_tensors_key: str = "input_tensors",
        labels_key: str = "labels",
    ) -> None:
        if top_n < 1:
            raise ValueError(f"top_n={top_n} must be >= 1 (the candidates re-scored per query)")
        super().__init__(optimizer, scheduler, loaders_train, loaders_val, input_tensors_key, labels_key)
        self.pairwise_model = pairwise_model
        self.extractor = extractor
        if extractor is not None:
            extractor.requires_grad_(False)
        self.top_n = top_n

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.extractor is None:
            return inputs
        self.extractor.eval()
        with torch.no_grad():
            return self.extractor(inputs)  # type: ignore[no-any-return]

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``(N, D)``, ``(N, D)`` -> ``(N,)`` same-class logits."""
        return self.pairwise_model(a, b)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self.unpack(batch)
        embeddings = self.embed(inputs)
        first, second = self._hard_pairs(embeddings)
        logits = self.pairwise_model(embeddings[first], embeddings[second])
        same = labels[first] == labels[second]
        losses = nn.functional.binary_cross_entropy_with_logits(logits, same.to(logits.dtype), reduction="none")
        positive = losses[same].mean() if bool(same.any()) else losses.new_zeros(())
        negative = losses[~same].mean() if bool((~same).any()) else losses.new_zeros(())
        loss = (positive + negative) / 2
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels))
        return loss

    def _hard_pairs(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample with its ``top_n`` nearest others of the batch: the pairs the model re-scores later."""
        gaps = distances(embeddings, embeddings)
        gaps.fill_diagonal_(float("inf"))
        nearest = gaps.topk(min(self.top_n, len(embeddings) - 1), dim=1, largest=False).indices
        first = torch.arange(len(embeddings), device=embeddings.device).repeat_interleave(nearest.shape[1])
        return first, nearest.flatten()

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        if len(labels) < 2:
            raise ValueError(f"{len(labels)} validation sample(s): retrieval needs at least 2")
        top_n = min(self.top_n, len(labels) - 1)
        queries = torch.arange(get_rank(), len(labels), get_world_size(), device=labels.device)
        gaps = distances(embeddings[queries], embeddings)
        gaps[torch.arange(len(queries)), queries] = float("inf")  # a query is not its own answer
        candidates = gaps.topk(top_n, dim=1, largest=False).indices  # (Q, top_n), nearest first
        with torch.no_grad():
            scores = self.pairwise_model(
                embeddings[queries].unsqueeze(1).expand(-1, top_n, -1).reshape(-1, embeddings.shape[1]),
                embeddings[candidates.flatten()],
            ).reshape(-1, top_n)
        reranked = candidates.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)
        correct = torch.stack(
            [(labels[candidates[:, 0]] == labels[queries]).sum(), (labels[reranked] == labels[queries]).sum()]
        )
        before, after = sync_ddp(correct, reduce_op="sum").tolist()
        return {"precision_at_1_before": before / len(labels), "precision_at_1_after": after / len(labels)}


def _default_triplet_loss(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return triplet_loss(embeddings, labels, margin=0.5)


def _check_loaders(loaders: Loaders | None, name: str) -> None:
    if loaders is None or isinstance(loaders, DataLoader):
        return
    if not isinstance(loaders, (list, tuple)) or not all(isinstance(loader, DataLoader) for loader in loaders):
        raise TypeError(
            f"{name} must be a DataLoader or a list or tuple of DataLoaders; got "
            f"{type(loaders).__name__}"
            + (f" of {[type(loader).__name__ for loader in loaders]}" if isinstance(loaders, (list, tuple)) else "")
        )


def _patched(loaders: Loaders) -> list[DataLoader[Any]]:
    """The loaders as a list, patched for DDP when a process group runs (else unchanged, without a warning)."""
    listed = [loaders] if isinstance(loaders, DataLoader) else list(loaders)
    return [patch_dataloader_to_ddp(loader) for loader in listed] if is_distributed() else listed
