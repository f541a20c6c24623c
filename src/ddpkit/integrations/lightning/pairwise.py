"""``PairwiseModuleDDP``: OML's module that trains a pairwise re-ranker; ``PairwiseScorer``, a small one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit._compat import override
from ddpkit.collectives import sync_ddp
from ddpkit.integrations.lightning.module_ddp import Loaders
from ddpkit.integrations.lightning.retrieval import OMLOptions, RetrievalValidation, check_oml_order
from ddpkit.metric_learning import distances
from ddpkit.process_group import get_rank, get_world_size

__all__ = ["PairwiseModuleDDP", "PairwiseScorer"]


class PairwiseScorer(nn.Module):
    """A pairwise model for :class:`PairwiseModuleDDP`: ``(N, D)`` and ``(N, D)`` embeddings -> ``(N,)`` logits
    that the two are of the same class, from ``[|x1 - x2|, x1 * x2]`` through an MLP (``hidden`` units, default 64).
    """

    def __init__(self, dim: int, hidden: int = 64) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    @override
    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([(x1 - x2).abs(), x1 * x2], dim=-1)).squeeze(-1)  # type: ignore[no-any-return]


class PairwiseModuleDDP(RetrievalValidation):
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
    ``validation_metrics``.

    Args:
        loaders_train, loaders_val: as in :class:`ModuleDDP`.
        pairwise_model: the model that scores pairs (required).
        pairs_miner: OML's miner of pairs (``sample(features, labels)``), or ``None``.
        criterion: the loss of OML's way (``None``: ``BCEWithLogitsLoss``).
        optimizer: over ``pairwise_model``'s parameters.
        scheduler, scheduler_interval, scheduler_frequency: as in :class:`ExtractorModuleDDP`.
        input_tensors_key, labels_key, embeddings_key: as in :class:`ExtractorModuleDDP`.
        scheduler_monitor_metric, freeze_n_epochs: as in :class:`ExtractorModuleDDP` (the
            pairwise model is the one frozen).
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
        check_oml_order(type(self).__name__, loaders_train, "pairwise_model")
        if pairwise_model is None:
            raise ValueError("PairwiseModuleDDP needs pairwise_model=... (the model that scores pairs)")
        if top_n < 1:
            raise ValueError(f"top_n={top_n} must be >= 1 (the candidates re-scored per query)")
        options = OMLOptions(
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

    @override
    @property
    def model(self) -> nn.Module:
        """The pairwise model (OML's attribute name)."""
        return self.pairwise_model

    @override
    def embed(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.extractor is None:
            return inputs
        self.extractor.eval()
        with torch.no_grad():
            return self.extractor(inputs)  # type: ignore[no-any-return]

    @override
    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        """The pairwise model's scores of ``(N, ...)`` and ``(N, ...)`` pairs: ``(N,)``."""
        return self.pairwise_model(x1, x2)  # type: ignore[no-any-return]

    @override
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

    @override
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
