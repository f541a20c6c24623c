"""``ExtractorModuleDDP``: OML's module that trains an embedding extractor, with exact retrieval metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit._compat import override
from ddpkit.integrations.lightning.module_ddp import Loaders
from ddpkit.integrations.lightning.retrieval import OMLOptions, RetrievalValidation, check_oml_order
from ddpkit.metric_learning import precision_at_1, triplet_loss

__all__ = ["Criterion", "ExtractorModuleDDP"]

#: ``criterion(embeddings (B, D), labels (B,)) -> scalar loss``.
Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ExtractorModuleDDP(RetrievalValidation):
    """Train an embedding extractor under DDP; log retrieval precision@1 of the whole validation split.

    OML's ``ExtractorModuleDDP``: ``ExtractorModuleDDP(loaders_train, loaders_val,
    extractor, criterion, optimizer, scheduler, scheduler_interval,
    scheduler_frequency, input_tensors_key, labels_key, embeddings_key,
    scheduler_monitor_metric, freeze_n_epochs)``, positionally or by keyword.

    Training: ``criterion(extractor(inputs), labels)``; the default criterion
    (``None``; OML has none) is ``triplet_loss`` with
    margin 0.5, whose positives and negatives come from every rank's batch
    through :func:`~ddpkit.all_gather_ddp_if_available` with ``sync_grads=True``
    (so every rank's batch must have the same size: use a batch sampler such as
    a P x K sampler). Validation: the embeddings of the split (the extractor's
    ``extract()`` when it has one, as OML's), gathered in single-process order
    with :func:`~ddpkit.gather_in_order`, give ``precision_at_1`` (the share of
    samples whose nearest other sample has their label), logged and kept in
    ``validation_metrics``; it equals a single-process evaluation of the same
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
        check_oml_order(type(self).__name__, loaders_train, "extractor")
        if extractor is None:
            raise ValueError("ExtractorModuleDDP needs extractor=... (the model that maps inputs to embeddings)")
        options = OMLOptions(
            scheduler, scheduler_interval, scheduler_frequency, input_tensors_key, labels_key, embeddings_key,
            scheduler_monitor_metric, freeze_n_epochs,
        )  # fmt: skip
        super().__init__(loaders_train, loaders_val, extractor, optimizer, options)
        self.extractor = extractor
        self.criterion: Criterion = criterion if criterion is not None else _default_triplet_loss

    @override
    @property
    def model(self) -> nn.Module:
        """The extractor (OML's attribute name)."""
        return self.extractor

    @override
    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        extract = getattr(self.extractor, "extract", None)
        return extract(inputs) if callable(extract) else self.extractor(inputs)  # type: ignore[no-any-return]

    @override
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``(B, ...)`` inputs -> ``(B, D)`` embeddings."""
        return self.extractor(inputs)  # type: ignore[no-any-return]

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self.unpack(batch)
        loss = self.criterion(self.extractor(inputs), labels)
        self.log("train_loss", loss.detach(), on_step=False, on_epoch=True, sync_dist=True, batch_size=len(labels))
        return loss

    @override
    def split_metrics(self, embeddings: torch.Tensor, labels: torch.Tensor, *inputs: torch.Tensor) -> dict[str, float]:
        return {"precision_at_1": precision_at_1(embeddings, labels)}


def _default_triplet_loss(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return triplet_loss(embeddings, labels, margin=0.5)
