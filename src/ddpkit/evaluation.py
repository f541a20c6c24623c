"""Evaluation with metrics equal to one process's: each rank predicts its shard, the results come back in order.

Used by :meth:`ddpkit.TrainLoop.evaluate`. A loader that is not sharded yet is
sharded without padding (each sample on exactly one rank); one that is (padded,
say) keeps its shards, and :func:`~ddpkit.gather_in_order` drops the padded
duplicates. Every rank gets the whole split's predictions and targets, in the
order one process would have produced them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.loaders import build_loader_sampler, distributed_sampler_of
from ddpkit.ordered import gather_in_order
from ddpkit.process_group import get_rank, get_world_size

__all__ = ["predict_in_order", "sharded_for_evaluation"]

#: ``(model, batch) -> (predictions, targets)``, one row per sample.
PredictStep = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]


def sharded_for_evaluation(loader: DataLoader[Any]) -> tuple[DataLoader[Any], DistributedSampler[Any]]:
    """``loader`` and its distributed sampler; a loader without one is rebuilt with unpadded shards."""
    sampler = distributed_sampler_of(loader)
    if sampler is not None:
        return loader, sampler
    return build_loader_sampler(loader, False, get_world_size(), get_rank(), even_shards=False)


def predict_in_order(
    model: nn.Module, loader: DataLoader[Any], predict_step: PredictStep, to_device: Callable[[Any], Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole split's ``(predictions, targets)`` in single-process order, on every rank (all must call it).

    ``model`` runs in eval mode without gradients and is put back in the mode
    it was in, also when ``predict_step`` raises.
    """
    loader, sampler = sharded_for_evaluation(loader)
    was_training = model.training
    model.eval()
    predictions: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for batch in loader:
                output, target = predict_step(model, to_device(batch))
                predictions.append(output.detach())
                targets.append(target.detach())
            if not predictions:  # an empty shard still needs the right shapes
                output, target = predict_step(model, to_device(_first_batch(loader)))
                predictions, targets = [output[:0]], [target[:0]]
    finally:
        model.train(was_training)
    return gather_in_order(torch.cat(predictions), sampler), gather_in_order(torch.cat(targets), sampler)


def _first_batch(loader: DataLoader[Any]) -> Any:
    """One sample of the loader's dataset, collated as a batch (for the shapes of an empty shard)."""
    return loader.collate_fn([loader.dataset[0]])
