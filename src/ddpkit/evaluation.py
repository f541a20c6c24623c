"""Evaluation with metrics equal to one process's: each rank predicts its shard, the results come back in order.

Used by :meth:`ddpkit.TrainLoop.evaluate`. A loader that is not sharded yet is
sharded without padding (each sample on exactly one rank); one that is (padded,
say) keeps its shards, and :func:`~ddpkit.gather_in_order` drops the padded
duplicates. Every rank gets the whole split's predictions and targets, in the
order one process would have produced them. A loader over a stream reads each
rank's part of it once (no padding) and :func:`~ddpkit.gather_stream_in_order`
puts the results in stream order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data._utils.collate import default_collate

from ddpkit.loaders import build_loader_sampler, distributed_sampler_of, stream_loader
from ddpkit.ordered import gather_each_in_order, gather_each_stream_in_order
from ddpkit.process_group import get_rank, get_world_size
from ddpkit.streams import StreamBatch, StreamDataLoader, is_stream

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
    if is_stream(loader):
        stream = stream_loader(loader)
        batches: Any = stream.iter_tagged("join")
    else:
        loader, sampler = sharded_for_evaluation(loader)
        batches = (StreamBatch(batch, _NO_KEYS) for batch in loader)
    was_training = model.training
    model.eval()
    predictions: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for tagged in batches:
                output, target = predict_step(model, to_device(tagged.batch))
                predictions.append(output.detach())
                targets.append(target.detach())
                keys.append(tagged.keys)
            if not predictions:  # an empty shard still needs the right shapes
                first = _first_stream_batch(stream) if is_stream(loader) else _first_batch(loader)
                output, target = predict_step(model, to_device(first))
                predictions, targets, keys = [output[:0]], [target[:0]], [torch.zeros(0, 3, dtype=torch.int64)]
    finally:
        model.train(was_training)
    both = (torch.cat(predictions), torch.cat(targets))  # gathered in one exchange
    gathered = (
        gather_each_stream_in_order(both, torch.cat(keys)) if is_stream(loader) else gather_each_in_order(both, sampler)
    )
    return gathered[0], gathered[1]


_NO_KEYS = torch.zeros(0, 3, dtype=torch.int64)


def _first_stream_batch(loader: StreamDataLoader) -> Any:
    """The stream's first item, collated as a batch (for the shapes of a rank whose part is empty)."""
    collate = loader.collate_fn.collate_fn or default_collate  # type: ignore[union-attr]
    return collate([next(iter(loader.stream.dataset))])


def _first_batch(loader: DataLoader[Any]) -> Any:
    """One sample of the loader's dataset, collated as a batch (for the shapes of an empty shard)."""
    return loader.collate_fn([loader.dataset[0]])
