"""The digits classifier and its TrainLoop, as the tests build them (one place, so that tests compare like with like).

Top-level functions only: the session pool's workers and the launcher's processes import them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ddpkit import TrainLoop
from ddpkit.examples.digits import digits_datasets

__all__ = ["digits_loop", "digits_model"]


def digits_model(hidden: int = 32, dropout: float = 0.0, seed: int | None = 0) -> nn.Module:
    """``64 pixels -> hidden (ReLU, then dropout if > 0) -> 10 classes``, initialised after ``torch.manual_seed(seed)``
    (``None``: from the global generator as it is)."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(64, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


def digits_loop(
    batch_size: int = 32,
    *,
    model: nn.Module | None = None,
    loader: DataLoader[Any] | None = None,
    train: Dataset[Any] | None = None,
    samples: int | None = None,
    shuffle: bool = True,
    drop_last: bool = False,
    validation_batch_size: int | None = 100,
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
    **kwargs: Any,
) -> TrainLoop:
    """A TrainLoop on the digits (split with seed 0): ``train`` (default the training split; its first ``samples``
    items if given) in batches of ``batch_size``, the validation split in batches of ``validation_batch_size``
    (``None``: no validation loader), ``optimizer(model.parameters())`` (default: TrainLoop's own), no progress bar
    unless ``progress=True`` is passed; every other keyword goes to :class:`ddpkit.TrainLoop`."""
    train_split, validation = digits_datasets(seed=0)
    data: Dataset[Any] = train if train is not None else train_split
    if samples is not None:
        data = Subset(data, range(samples))
    model = model if model is not None else digits_model()
    if optimizer is not None:
        kwargs["optimizer"] = optimizer(model.parameters())
    kwargs.setdefault("progress", False)
    validation_loader = None if validation_batch_size is None else DataLoader(validation, validation_batch_size)
    if loader is None:
        loader = DataLoader(data, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    return TrainLoop(model, loader, validation_loader, **kwargs)
