"""``ModuleDDP``: OML's LightningModule that holds its loaders and shards them for DDP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ddpkit._compat import override
from ddpkit.loaders import patch_dataloader_to_ddp
from ddpkit.process_group import is_distributed

__all__ = ["Loaders", "ModuleDDP"]

Loaders = DataLoader[Any] | Sequence[DataLoader[Any]]


class ModuleDDP(pl.LightningModule):
    """A ``LightningModule`` that holds its loaders and shards them for DDP (OML's ``ModuleDDP``).

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

    @override
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

    @override
    def val_dataloader(self) -> Any:
        """``loaders_val``, patched for DDP (called by the ``Trainer``); no validation when ``None``."""
        if self.loaders_val is None:
            self.patched_val_loaders = []
            return []
        self.patched_val_loaders = _patched(self.loaders_val)
        return self.patched_val_loaders[0] if isinstance(self.loaders_val, DataLoader) else self.patched_val_loaders


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
