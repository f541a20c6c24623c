"""Evaluation with metrics equal to one process's: each rank predicts its part, the results come back in order.

Used by :meth:`ddpkit.TrainLoop.evaluate`. A map-style loader that is not
sharded yet is sharded without padding (each sample on exactly one rank); one
that is (padded, say) keeps its shards, and :func:`~ddpkit.gather_in_order`
drops the padded duplicates. A loader over a stream reads each rank's part of
it once (no padding) and :func:`~ddpkit.gather_stream_in_order` puts the
results in stream order. Every rank gets the whole split's predictions and
targets, in the order one process would have produced them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit.collectives import sync_ddp
from ddpkit.training._sources import epoch_source

__all__ = ["PredictStep", "predict_in_order"]

T = TypeVar("T")

#: ``(model, batch) -> (predictions, targets)``, one row per sample.
PredictStep = Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]


def predict_in_order(
    model: nn.Module, loader: DataLoader[Any], predict_step: PredictStep, to_device: Callable[[Any], Any],
    together: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The whole split's ``(predictions, targets)`` in single-process order, on every rank (all must call it).

    ``predictions`` and ``targets`` have one row per item of the split
    (``(len(split), *row_shape)``). ``model`` runs in eval mode without
    gradients and is put back in the mode it was in, also when
    ``predict_step`` raises. ``together``: every forward is a collective (a
    sharded model's): the ranks agree before each batch whether any has one
    left, and a rank whose part has ended runs the split's first item and
    drops the result.
    """
    source = epoch_source(loader)
    was_training = model.training
    model.eval()
    predictions: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    shapes: tuple[torch.Tensor, torch.Tensor] | None = None  # a dropped result's, for an empty part
    try:
        with torch.no_grad():
            for tagged in _together(source.evaluation_batches()) if together else source.evaluation_batches():
                if tagged is None:  # this rank's part has ended, another's has not
                    output, target = predict_step(model, to_device(source.first_batch()))
                    shapes = (output[:0].detach(), target[:0].detach())
                    continue
                output, target = predict_step(model, to_device(tagged.batch))
                predictions.append(output.detach())
                targets.append(target.detach())
                keys.append(tagged.keys)
            if not predictions and shapes is not None:
                predictions, targets, keys = [shapes[0]], [shapes[1]], [torch.zeros(0, 3, dtype=torch.int64)]
            if not predictions:  # an empty part still needs the right shapes
                output, target = predict_step(model, to_device(source.first_batch()))
                predictions, targets, keys = [output[:0]], [target[:0]], [torch.zeros(0, 3, dtype=torch.int64)]
    finally:
        model.train(was_training)
    gathered = source.gather_in_order((torch.cat(predictions), torch.cat(targets)), torch.cat(keys))  # one exchange
    return gathered[0], gathered[1]


def _together(batches: Iterator[T]) -> Iterator[T | None]:
    """``batches``, then ``None`` until every rank's have ended (one small all-reduce before each batch)."""
    while True:
        item = next(batches, None)
        left = sync_ddp(torch.tensor([int(item is not None)]), reduce_op="max")
        if not int(left):
            return
        yield item
