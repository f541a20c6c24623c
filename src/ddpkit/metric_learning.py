"""Metric learning across ranks: a triplet loss with every rank's negatives, and precision@1.

Used by the retrieval demo (``ddpkit demo --task retrieval``) and the Lightning
integration (after OML, a metric-learning library).
"""

from __future__ import annotations

import torch

from ddpkit.collectives import all_gather_ddp_if_available
from ddpkit.process_group import get_rank

__all__ = ["distances", "precision_at_1", "triplet_loss"]


def distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances ``(len(a), len(b))`` between the rows of ``(N, D)`` ``a`` and ``(M, D)`` ``b``.

    Computed as ``sqrt(|a|^2 + |b|^2 - 2 a.b)``, clamped at 1e-12 before the root
    so that the gradient stays finite at distance 0.
    """
    squared = a.pow(2).sum(1, keepdim=True) + b.pow(2).sum(1)[None, :] - 2 * a @ b.T
    return squared.clamp_min(1e-12).sqrt()


def triplet_loss(embeddings: torch.Tensor, labels: torch.Tensor, margin: float) -> torch.Tensor:
    """Triplet loss over all triplets, with positives and negatives from every rank (every rank must call it).

    Each of this rank's ``(B, D)`` embeddings (labels ``(B,)``) is an anchor; its
    positives (other samples of its class) and negatives (samples of other
    classes) are all ranks' batches, gathered with
    :func:`~ddpkit.all_gather_ddp_if_available` (``sync_grads=True``: the
    gradient through another rank's embeddings flows back to the rank that
    computed them). An anchor's loss is the mean of ``relu(d(a, p) - d(a, n) +
    margin)`` over its triplets; the result is the mean over the anchors. Every
    rank's batch must have the same size. With W ranks of batch B, the
    parameters' gradient (averaged by DDP) equals the single-process gradient of
    one batch of ``W * B``.

    Returns:
        the loss, a scalar.

    Raises:
        CollectiveMismatchError: the ranks' batches differ in size (on every rank).
    """
    rank, batch = get_rank(), len(embeddings)
    everyone = all_gather_ddp_if_available(embeddings, sync_grads=True).reshape(-1, *embeddings.shape[1:])
    all_labels = all_gather_ddp_if_available(labels).reshape(-1)
    gaps = distances(embeddings, everyone)  # (B, W * B)
    same = labels[:, None] == all_labels[None, :]
    itself = torch.zeros_like(same)
    itself[torch.arange(batch), torch.arange(batch) + rank * batch] = True
    valid = (same & ~itself)[:, :, None] & ~same[:, None, :]  # (anchor, positive, negative)
    losses = torch.relu(gaps[:, :, None] - gaps[:, None, :] + margin) * valid
    per_anchor = losses.sum(dim=(1, 2)) / valid.sum(dim=(1, 2)).clamp_min(1)
    return per_anchor.mean()


def precision_at_1(embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    """Share of samples whose nearest other sample in ``(N, D)`` ``embeddings`` has the same label ``(N,)``.

    Local: call it with the whole split (e.g. from :func:`~ddpkit.gather_in_order`).

    Raises:
        ValueError: fewer than 2 samples.
    """
    if len(labels) < 2:
        raise ValueError(f"precision@1 needs at least 2 samples; got {len(labels)}")
    gaps = distances(embeddings, embeddings)
    gaps.fill_diagonal_(float("inf"))
    nearest = gaps.argmin(dim=1)
    return float((labels[nearest] == labels).double().mean())
