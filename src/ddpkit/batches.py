"""Batches as nested containers: one walker for dicts, sequences, namedtuples, sets and dataclasses.

Everything in ddpkit that looks inside a batch goes through ``map_tensors``
(rebuild it with every tensor transformed) or :func:`iter_tensors` (every
tensor, in order): moving a batch to a device, finding the tensors DDP must
watch, counting a batch's samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["batch_length", "iter_tensors", "map_tensors", "move_data_to_device"]


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` rebuilt with ``fn`` applied to every tensor inside it; containers are never changed in place.

    Mappings keep their type (a ``defaultdict`` its factory; a type that cannot be
    rebuilt from a dict becomes one), namedtuples, lists, tuples, sets and
    dataclass instances (fields with ``init=False`` included) theirs; anything
    else is returned as it is.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        items = {key: map_tensors(item, fn) for key, item in value.items()}
        kind: Any = type(value)
        try:
            return kind(value.default_factory, items) if hasattr(value, "default_factory") else kind(items)
        except TypeError:
            return items
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(item, fn) for item in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(map_tensors(item, fn) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        copy = dataclasses.replace(value, **{f.name: map_tensors(getattr(value, f.name), fn) for f in fields if f.init})
        for field in fields:
            if not field.init:
                object.__setattr__(copy, field.name, map_tensors(getattr(value, field.name), fn))
        return copy
    return value


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``, depth first, in the containers' order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from iter_tensors(item)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from iter_tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, field.name))


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """``batch`` with every tensor moved to ``device``, through nested containers (see ``map_tensors``).

    A tensor already there is kept as it is; a copy from CPU to a CUDA device does
    not block (``non_blocking=True``).

    Args:
        batch: the data.
        device: target, e.g. ``"cuda:0"``, ``torch.device("cpu")`` or a CUDA index.
    """
    target = device if isinstance(device, torch.device) else torch.device(device)
    non_blocking = target.type == "cuda"
    if isinstance(batch, torch.Tensor):  # the common cases, without the walk through containers
        return batch if batch.device == target else batch.to(target, non_blocking=non_blocking)
    if type(batch) in (tuple, list) and all(type(t) is torch.Tensor and t.device == target for t in batch):
        return batch if type(batch) is tuple else list(batch)  # (inputs, targets) already there
    return map_tensors(batch, lambda t: t if t.device == target else t.to(target, non_blocking=non_blocking))


def batch_length(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 for a 0-d tensor or no tensor at all)."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:  # (inputs, targets)
        shape = batch[0].shape
        return int(shape[0]) if shape else 1
    first = next(iter_tensors(batch), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1
