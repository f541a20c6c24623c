"""What OML's two Lightning modules share: OML's arguments, optimizers and schedulers, freezing, batch keys,
and a validation that gathers the whole split's embeddings in single-process order for exact metrics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit._compat import override
from ddpkit.integrations.lightning.module_ddp import Loaders, ModuleDDP
from ddpkit.ordered import gather_in_order
from ddpkit.process_group import is_distributed

__all__ = ["OMLOptions", "RetrievalValidation", "check_oml_order"]


class RetrievalValidation(ModuleDDP):
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
        options: OMLOptions,
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

    @override
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

    @override
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

    @override
    def on_validation_epoch_start(self) -> None:
        self._collected = {}

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """Collects the batch's embeddings and labels; returns OML's output, ``{**batch, embeddings_key: ...}``
        for a dict batch (what OML's metric callbacks read), else ``None``."""
        inputs, labels = self.unpack(batch)
        with torch.no_grad():
            embeddings = self.batch_embeddings(batch, inputs).detach()
        collected = (embeddings, labels.detach(), *((inputs.detach(),) if self._collects_inputs else ()))
        self._collected.setdefault(dataloader_idx, []).append(collected)
        return {**batch, self.embeddings_key: embeddings} if isinstance(batch, Mapping) else None

    @override
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


@dataclass(frozen=True)
class OMLOptions:
    """The arguments OML's ``ExtractorModule`` and ``PairwiseModule`` share after the model and optimizer."""

    scheduler: Any
    scheduler_interval: str
    scheduler_frequency: int
    input_tensors_key: str
    labels_key: str
    embeddings_key: str
    scheduler_monitor_metric: str | None
    freeze_n_epochs: int


def check_oml_order(name: str, loaders_train: Any, model_argument: str) -> None:
    """A model where the training loaders go: the positional order is OML's, loaders first."""
    if isinstance(loaders_train, nn.Module):
        raise TypeError(
            f"{name} takes OML's arguments, loaders first: {name}(loaders_train, loaders_val, {model_argument}, "
            f"...); got a {type(loaders_train).__name__} as loaders_train. Pass {model_argument}=... by keyword"
        )
