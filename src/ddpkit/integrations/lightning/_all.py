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

The constructors take OML's arguments (``loaders_train``, ``loaders_val``,
then those of OML's ``ExtractorModule`` / ``PairwiseModule``), so OML code runs
unchanged; batches are dicts keyed by ``input_tensors_key``, ``labels_key`` and
(for OML's pairs miner) ``embeddings_key``, or ``(inputs, labels, ...)`` tuples.

Example::

    model = ExtractorModuleDDP(loaders_train=train_loader, loaders_val=val_loader,
                               extractor=extractor, criterion=None, optimizer=optimizer)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
                      use_distributed_sampler=False, max_epochs=5)
    trainer.fit(model)          # no loaders here: the module holds them
    model.validation_metrics    # {"precision_at_1": ...}, the same on every rank
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
        #: The patched training loaders the trainer got last, and the validation ones (``dataloader_idx`` order).
        self.patched_train_loaders: list[DataLoader[Any]] = []
        self.patched_val_loaders: list[DataLoader[Any]] = []

    def train_dataloader(self) -> Any:
        """``loaders_train``, patched for DDP (called by the ``Trainer``)."""
        if self.loaders_train is None:
            raise ValueError(
                f"{type(self).__name__} was created with loaders_train=None, so it cannot be trained: pass "
                "loaders_train=... when creating it (give loaders to the module, not to trainer.fit)"
            )
        self.patched_train_loaders = _patched(self.loaders_train)
        return (
            self.patched_train_loaders[0] if isinstance(self.loaders_train, DataLoader) else self.patched_train_loaders
        )

    def val_dataloader(self) -> Any:
        """``loaders_val``, patched for DDP (called by the ``Trainer``); no validation when ``None``."""
        if self.loaders_val is None:
            self.patched_val_loaders = []
            return []
        self.patched_val_loaders = _patched(self.loaders_val)
        return self.patched_val_loaders[0] if isinstance(self.loaders_val, DataLoader) else self.patched_val_loaders


class _RetrievalValidation(ModuleDDP):
    """What OML's two modules share: optimizers and schedulers, freezing, batch keys, and a validation that
    collects embeddings and labels per loader so that subclasses compute metrics over the whole split."""

    #: Whether validation also collects the inputs (for a pairwise model that scores inputs).
    _collects_inputs = False

    def __init__(
        self,
        loaders_train: Loaders | None,
        loaders_val: Loaders | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        options: _OMLOptions,
    ) -> None:
        super().__init__(loaders_train, loaders_val)
        if options.scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval={options.scheduler_interval!r} must be 'step' or 'epoch'")
        if options.freeze_n_epochs and not (
            callable(getattr(model, "freeze", None)) and callable(getattr(model, "unfreeze", None))
        ):
            raise ValueError(
                f"freeze_n_epochs={options.freeze_n_epochs} needs a model with freeze() and unfreeze() methods (OML's "
                f"IFreezable); {type(model).__name__} has none"
            )
        self.optimizer = optimizer
        self.scheduler = options.scheduler
        self.scheduler_interval = options.scheduler_interval
        self.scheduler_frequency = options.scheduler_frequency
        self.monitor_metric = options.scheduler_monitor_metric
        self.input_tensors_key = options.input_tensors_key
        self.labels_key = options.labels_key
        self.embeddings_key = options.embeddings_key
        self.freeze_n_epochs = options.freeze_n_epochs
        #: The metrics of the last full validation, as exact Python floats (the same on every rank).
        self.validation_metrics: dict[str, float] = {}
        self._collected: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def configure_optimizers(self) -> Any:
        """The optimizer and, as OML configures it, its scheduler (``interval``, ``frequency``, ``monitor``)."""
        if self.scheduler is None:
            return self.optimizer
        config: dict[str, Any] = {
            "scheduler": self.scheduler,
            "interval": self.scheduler_interval,
            "frequency": self.scheduler_frequency,
        }
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            config["monitor"] = self.monitor_metric
        return [self.optimizer], [config]

    def on_train_epoch_start(self) -> None:
        """OML's freezing: the model is frozen for the first ``freeze_n_epochs`` epochs, then unfrozen."""
        if self.freeze_n_epochs:
            model: Any = self.model
            model.unfreeze() if self.current_epoch >= self.freeze_n_epochs else model.freeze()

    @property
    def model(self) -> nn.Module:
        """The trained model (OML's attribute name)."""
        raise NotImplementedError

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

    def batch_embeddings(self, batch: Any, inputs: torch.Tensor) -> torch.Tensor:
        """A batch's embeddings for retrieval: ``batch[embeddings_key]`` when a dict batch holds them, else
        :meth:`embed` of the inputs."""
        if isinstance(batch, Mapping) and self.embeddings_key in batch:
            return batch[self.embeddings_key]  # type: ignore[no-any-return]
        return self.embed(inputs)

    def on_validation_epoch_start(self) -> None:
        self._collected = {}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Collects the batch's embeddings and labels; returns OML's output, ``{**batch, embeddings_key: ...}``
        for a dict batch (what OML's metric callbacks read), else ``None``."""
        inputs, labels = self.unpack(batch)
        with torch.no_grad():
            embeddings = self.batch_embeddings(batch, inputs).detach()
        collected = (embeddings, labels.detach(), *((inputs.detach(),) if self._collects_inputs else ()))
        self._collected.setdefault(dataloader_idx, []).append(collected)
        return {**batch, self.embeddings_key: embeddings} if isinstance(batch, Mapping) else None

    def on_validation_epoch_end(self) -> None:
        collected, self._collected = self._collected, {}
        if self.trainer.sanity_checking:  # a few batches only: not the split, so no metric
            return
        metrics: dict[str, float] = {}
        for idx, loader in enumerate(self.patched_val_loaders):
            parts = collected.get(idx, [])
            columns = [torch.cat(column) for column in zip(*parts, strict=True)] if parts else []
            if not columns:  # an empty shard: gather_in_order takes an empty result
                columns = [torch.empty(0, 0), torch.empty(0, dtype=torch.int64)]
                columns += [torch.empty(0)] if self._collects_inputs else []
            if is_distributed():  # every rank gets the whole split in single-process order, duplicates removed
                columns = [gather_in_order(column, loader) for column in columns]
            suffix = "" if len(self.patched_val_loaders) == 1 else f"/{idx}"
            for name, value in self.split_metrics(*columns).items():
                metrics[name + suffix] = value
        self.validation_metrics = metrics
        for name, value in metrics.items():
            # Identical on every rank already, so their mean (sync_dist) is the value itself.
            self.log(name, value, sync_dist=True)

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor, *inputs: torch.Tensor) -> dict[str, float]:
        """Metrics of a whole validation split: ``(N, D)`` embeddings and ``(N,)`` labels, on every rank."""
        raise NotImplementedError


class ExtractorModuleDDP(_RetrievalValidation):
    """Train an embedding extractor under DDP; log retrieval precision@1 of the whole validation split.

    OML's ``ExtractorModuleDDP``: ``ExtractorModuleDDP(loaders_train, loaders_val,
    extractor, criterion, optimizer, scheduler, scheduler_interval,
    scheduler_frequency, input_tensors_key, labels_key, embeddings_key,
    scheduler_monitor_metric, freeze_n_epochs)``, positionally or by keyword.

    Training: ``criterion(extractor(inputs), labels)``; the default criterion
    (``None``; OML has none) is :func:`~ddpkit.metric_learning.triplet_loss` with
    margin 0.5, whose positives and negatives come from every rank's batch
    through :func:`~ddpkit.all_gather_ddp_if_available` with ``sync_grads=True``
    (so every rank's batch must have the same size: use a batch sampler such as
    a P x K sampler). Validation: the embeddings of the split (the extractor's
    ``extract()`` when it has one, as OML's), gathered in single-process order
    with :func:`~ddpkit.gather_in_order`, give ``precision_at_1`` (the share of
    samples whose nearest other sample has their label), logged and kept in
    :attr:`validation_metrics`; it equals a single-process evaluation of the same
    weights exactly. ``validation_step`` returns OML's ``{**batch,
    embeddings_key: embeddings}`` for dict batches.

    Args:
        loaders_train, loaders_val: as in :class:`ModuleDDP`.
        extractor: ``(B, ...)`` inputs -> ``(B, D)`` embeddings (required).
        criterion: ``criterion(embeddings, labels) -> loss``; ``None``: the cross-rank triplet loss.
        optimizer: over ``extractor``'s parameters.
        scheduler: an optional learning-rate scheduler of ``optimizer``.
        scheduler_interval: ``"step"`` (default, as OML) or ``"epoch"``.
        scheduler_frequency: call the scheduler every this many intervals (default 1).
        input_tensors_key, labels_key, embeddings_key: the keys of dict batches
            (OML's defaults ``"input_tensors"``, ``"labels"``, ``"embeddings"``).
        scheduler_monitor_metric: the metric a ``ReduceLROnPlateau`` watches.
        freeze_n_epochs: keep the extractor frozen (its ``freeze()``) for this many
            epochs, then ``unfreeze()`` it (OML's ``IFreezable``).

    Raises:
        ValueError: no extractor; ``freeze_n_epochs`` with an extractor that cannot
            freeze; a bad ``scheduler_interval``; and as :class:`ModuleDDP`.
        TypeError: as :class:`ModuleDDP`.
    """

    def __init__(
        self,
        loaders_train: Loaders | None = None,
        loaders_val: Loaders | None = None,
        extractor: nn.Module | None = None,
        criterion: Criterion | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scheduler_interval: str = "step",
        scheduler_frequency: int = 1,
        input_tensors_key: str = "input_tensors",
        labels_key: str = "labels",
        embeddings_key: str = "embeddings",
        scheduler_monitor_metric: str | None = None,
        freeze_n_epochs: int = 0,
    ) -> None:
        _check_oml_order(type(self).__name__, loaders_train, "extractor")
        if extractor is None:
            raise ValueError("ExtractorModuleDDP needs extractor=... (the model that maps inputs to embeddings)")
        options = _OMLOptions(
            scheduler, scheduler_interval, scheduler_frequency, input_tensors_key, labels_key, embeddings_key,
            scheduler_monitor_metric, freeze_n_epochs,
        )  # fmt: skip
        super().__init__(loaders_train, loaders_val, extractor, optimizer, options)
        self.extractor = extractor
        self.criterion: Criterion = criterion if criterion is not None else _default_triplet_loss

    @property
    def model(self) -> nn.Module:
        """The extractor (OML's attribute name)."""
        return self.extractor

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        extract = getattr(self.extractor, "extract", None)
        return extract(inputs) if callable(extract) else self.extractor(inputs)  # type: ignore[no-any-return]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` inputs -> ``(B, D)`` embeddings."""
        return self.extractor(inputs)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self.unpack(batch)
        loss = self.criterion(self.extractor(inputs), labels)
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels))
        return loss

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor, *inputs: torch.Tensor) -> dict[str, float]:
        return {"precision_at_1": precision_at_1(embeddings, labels)}


class PairwiseScorer(nn.Module):
    """A pairwise model for :class:`PairwiseModuleDDP`: ``(N, D)`` and ``(N, D)`` embeddings -> ``(N,)`` logits
    that the two are of the same class, from ``[|x1 - x2|, x1 * x2]`` through an MLP (``hidden`` units, default 64).
    """

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([(x1 - x2).abs(), x1 * x2], dim=-1)).squeeze(-1)  # type: ignore[no-any-return]


class PairwiseModuleDDP(_RetrievalValidation):
    """Train a pairwise re-ranker under DDP; report precision@1 before and after re-ranking.

    OML's ``PairwiseModuleDDP``: ``PairwiseModuleDDP(loaders_train, loaders_val,
    pairwise_model, pairs_miner, criterion, optimizer, scheduler,
    scheduler_interval, scheduler_frequency, input_tensors_key, labels_key,
    embeddings_key, scheduler_monitor_metric, freeze_n_epochs)``, positionally or
    by keyword, plus ddpkit's keyword-only ``extractor`` and ``top_n``.

    Training, two ways:

    * With a ``pairs_miner`` (OML's way): ``pairs_miner.sample(features=<the
      batch's embeddings>, labels=...)`` gives ``(ids1, ids2, is_negative)``; the
      loss is ``criterion(pairwise_model(x1=inputs[ids1], x2=inputs[ids2]),
      is_negative.float())`` (default criterion: binary cross-entropy with
      logits). The model scores inputs, and a high score means "different".
    * Without one: the model scores embeddings, ``pairwise_model(a, b)`` returns
      ``(N,)`` logits that ``a`` and ``b`` are of the same class (e.g.
      :class:`PairwiseScorer`); each sample is paired with its ``top_n`` nearest
      others of this rank's batch, and the loss is the binary cross-entropy of
      those pairs, positives and negatives weighted equally (the mean over
      positive pairs plus the mean over negative pairs, halved; ``criterion`` is
      not used).

    A batch's embeddings are ``batch[embeddings_key]`` when a dict batch holds
    them (OML's datasets with pre-computed embeddings), else
    ``extractor(inputs)`` computed without gradients (the extractor is frozen:
    ``requires_grad`` off, eval mode); with ``extractor=None`` the inputs are the
    embeddings. DDP averages the gradients over ranks.

    Validation, over the whole split (gathered in single-process order with
    :func:`~ddpkit.gather_in_order`): each sample is a query against all the
    others; its ``top_n`` nearest candidates (Euclidean distance of the
    embeddings) are re-scored by the pairwise model and re-ordered. The queries
    are shared out over the ranks and the counts of correct top-1 answers summed
    with :func:`~ddpkit.sync_ddp`, so ``precision_at_1_before`` (nearest
    candidate) and ``precision_at_1_after`` (best-scored candidate) equal a
    single-process evaluation exactly. Both are logged and kept in
    :attr:`validation_metrics`.

    Args:
        loaders_train, loaders_val: as in :class:`ModuleDDP`.
        pairwise_model: the model that scores pairs (required).
        pairs_miner: OML's miner of pairs (``sample(features, labels)``), or ``None``.
        criterion: the loss of OML's way (``None``: ``BCEWithLogitsLoss``).
        optimizer: over ``pairwise_model``'s parameters.
        scheduler, scheduler_interval, scheduler_frequency, input_tensors_key,
            labels_key, embeddings_key, scheduler_monitor_metric,
            freeze_n_epochs: as in :class:`ExtractorModuleDDP` (the pairwise
            model is the one frozen).
        extractor: ``(B, ...)`` inputs -> ``(B, D)`` embeddings, frozen; ``None``: identity.
        top_n: candidates re-scored per query (default 5, >= 1).

    Raises:
        ValueError: no pairwise model; ``top_n`` < 1; and as :class:`ExtractorModuleDDP`.
    """

    def __init__(
        self,
        loaders_train: Loaders | None = None,
        loaders_val: Loaders | None = None,
        pairwise_model: nn.Module | None = None,
        pairs_miner: Any = None,
        criterion: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scheduler_interval: str = "step",
        scheduler_frequency: int = 1,
        input_tensors_key: str = "input_tensors",
        labels_key: str = "labels",
        embeddings_key: str = "embeddings",
        scheduler_monitor_metric: str | None = None,
        freeze_n_epochs: int = 0,
        *,
        extractor: nn.Module | None = None,
        top_n: int = 5,
    ) -> None:
        _check_oml_order(type(self).__name__, loaders_train, "pairwise_model")
        if pairwise_model is None:
            raise ValueError("PairwiseModuleDDP needs pairwise_model=... (the model that scores pairs)")
        if top_n < 1:
            raise ValueError(f"top_n={top_n} must be >= 1 (the candidates re-scored per query)")
        options = _OMLOptions(
            scheduler, scheduler_interval, scheduler_frequency, input_tensors_key, labels_key, embeddings_key,
            scheduler_monitor_metric, freeze_n_epochs,
        )  # fmt: skip
        super().__init__(loaders_train, loaders_val, pairwise_model, optimizer, options)
        self.pairwise_model = pairwise_model
        self.miner = pairs_miner
        self.criterion = criterion if criterion is not None else nn.BCEWithLogitsLoss()
        self.extractor = extractor
        if extractor is not None:
            extractor.requires_grad_(False)
        self.top_n = top_n
        self._collects_inputs = pairs_miner is not None  # OML's way scores inputs, so validation needs them

    @property
    def model(self) -> nn.Module:
        """The pairwise model (OML's attribute name)."""
        return self.pairwise_model

    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.extractor is None:
            return inputs
        self.extractor.eval()
        with torch.no_grad():
            return self.extractor(inputs)  # type: ignore[no-any-return]

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """The pairwise model's scores of ``(N, ...)`` and ``(N, ...)`` pairs: ``(N,)``."""
        return self.pairwise_model(x1, x2)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self.unpack(batch)
        embeddings = self.batch_embeddings(batch, inputs)
        if self.miner is not None:  # OML's way
            ids1, ids2, is_negative = self.miner.sample(features=embeddings, labels=labels)
            predictions = self.pairwise_model(x1=inputs[ids1], x2=inputs[ids2])
            loss = self.criterion(predictions, is_negative.float().to(predictions.device))
        else:
            first, second = self._hard_pairs(embeddings)
            logits = self.pairwise_model(embeddings[first], embeddings[second])
            same = labels[first] == labels[second]
            losses = nn.functional.binary_cross_entropy_with_logits(logits, same.to(logits.dtype), reduction="none")
            positive = losses[same].mean() if bool(same.any()) else losses.new_zeros(())
            negative = losses[~same].mean() if bool((~same).any()) else losses.new_zeros(())
            loss = (positive + negative) / 2
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels))
        return loss  # type: ignore[no-any-return]

    def _hard_pairs(self, embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample with its ``top_n`` nearest others of the batch: the pairs the model re-scores later."""
        gaps = distances(embeddings, embeddings)
        gaps.fill_diagonal_(float("inf"))
        nearest = gaps.topk(min(self.top_n, len(embeddings) - 1), dim=1, largest=False).indices
        first = torch.arange(len(embeddings), device=embeddings.device).repeat_interleave(nearest.shape[1])
        return first, nearest.flatten()

    def same_class_scores(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """``(N,)`` scores, higher for "same class": the model's logits, or minus its score in OML's way."""
        if self.miner is not None:
            return -self.pairwise_model(x1=x1, x2=x2)  # type: ignore[no-any-return]
        return self.pairwise_model(x1, x2)  # type: ignore[no-any-return]

    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor, *inputs: torch.Tensor) -> dict[str, float]:
        if len(labels) < 2:
            raise ValueError(f"{len(labels)} validation sample(s): retrieval needs at least 2")
        rows = inputs[0] if self.miner is not None else embeddings  # what the pairwise model scores
        top_n = min(self.top_n, len(labels) - 1)
        queries = torch.arange(get_rank(), len(labels), get_world_size(), device=labels.device)
        gaps = distances(embeddings[queries], embeddings)
        gaps[torch.arange(len(queries)), queries] = float("inf")  # a query is not its own answer
        candidates = gaps.topk(top_n, dim=1, largest=False).indices  # (Q, top_n), nearest first
        with torch.no_grad():
            scores = self.same_class_scores(
                rows[queries].unsqueeze(1).expand(-1, top_n, *rows.shape[1:]).reshape(-1, *rows.shape[1:]),
                rows[candidates.flatten()],
            ).reshape(-1, top_n)
        reranked = candidates.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)
        correct = torch.stack(
            [(labels[candidates[:, 0]] == labels[queries]).sum(), (labels[reranked] == labels[queries]).sum()]
        )
        before, after = sync_ddp(correct, reduce_op="sum").tolist()
        return {"precision_at_1_before": before / len(labels), "precision_at_1_after": after / len(labels)}


@dataclass(frozen=True)
class _OMLOptions:
    """The arguments OML's ``ExtractorModule`` and ``PairwiseModule`` share after the model and optimizer."""

    scheduler: Any
    scheduler_interval: str
    scheduler_frequency: int
    input_tensors_key: str
    labels_key: str
    embeddings_key: str
    scheduler_monitor_metric: str | None
    freeze_n_epochs: int


def _check_oml_order(name: str, loaders_train: Any, model_argument: str) -> None:
    """A model where the training loaders go: the positional order is OML's, loaders first."""
    if isinstance(loaders_train, nn.Module):
        raise TypeError(
            f"{name} takes OML's arguments, loaders first: {name}(loaders_train, loaders_val, {model_argument}, "
            f"...); got a {type(loaders_train).__name__} as loaders_train. Pass {model_argument}=... by keyword"
        )


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
