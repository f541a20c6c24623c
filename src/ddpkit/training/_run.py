"""How a ``TrainLoop`` runs: its set-up, the epoch runner, DDP's step driver, its checkpoints.

:class:`TrainingRun` is ``TrainLoop``'s base class: ``TrainLoop`` (``loop.py``)
holds what a user sees (arguments, the steps to override, ``fit``,
``evaluate``), this class what happens in between. Everything that changes
while it trains is in one :class:`~ddpkit.training.RunState`.

One epoch runner (:meth:`TrainingRun._run_epochs`) serves every way of training: callbacks, preemption, the
optimizer step and what follows it (step metrics, ``on_batch_end``, checkpoints every N steps), the epoch's
end (train loss, validation, schedule, its line, checkpoint). A :class:`StepDriver` makes each step's
gradients, averaged over every process that trains, and hands the runner a :class:`CommittedStep`: DDP's
(:class:`DDPSteps`: each rank its shard of each batch) or a fault-tolerant replica group's
(``_fault_tolerant.FaultTolerantSteps``: each step's items dealt over the quorum).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from ddpkit.batches import batch_length
from ddpkit.callbacks import CallbacksHandler
from ddpkit.checkpoint import CHECKPOINT_FILE
from ddpkit.collectives import mp_sync
from ddpkit.ddp_handler import DDPHandler
from ddpkit.ddp_plugin import DDPPlugin
from ddpkit.fault_tolerance import TorchFT
from ddpkit.hangs._stacks import dump_worker_stacks_in_hang_reports
from ddpkit.process_group import get_rank, get_world_size, is_distributed
from ddpkit.process_group._seeding import reseed_torch
from ddpkit.training._messages import epoch_line, skipped_model_error
from ddpkit.training._preemption import PreemptionHandler
from ddpkit.training._recipe import Recipe
from ddpkit.training._sources import epoch_source
from ddpkit.training._state import RunState, TrainState
from ddpkit.training._steps import GlobalBatch, TrainingEpochs, average_gradients

__all__ = ["CommittedStep", "DDPSteps", "StepDriver", "TrainingRun"]

log = logging.getLogger(__name__)


@dataclass
class CommittedStep:
    """An optimizer step whose gradients are ready: averaged over every rank (DDP) or every replica group of the
    step's quorum, and committed. The epoch runner takes the optimizer step and what follows.

    Attributes:
        position: entries of the epoch's global order done once this step is taken.
        sums: ``(2,)`` float64: the step's loss sum and item count over every process that trained it; ``None``
            when the driver counted each batch into the run state as it went (``RunState.add_batch``).
        metrics: what the step measured besides its loss (``replica_groups``), for ``step_metrics``.
        flags: SLURM's signals, averaged with the gradients (``PreemptionHandler.received_flags``); ``None``:
            the ranks agree on them with a collective.
    """

    position: int
    sums: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    flags: torch.Tensor | None = None


class StepDriver(Protocol):
    """How a run's steps come to be: the epoch runner's other half (a context manager around the run)."""

    #: Put before the epoch's line (a replica group's name).
    prefix: str

    @property
    def leader(self) -> bool:
        """Whether this process prints the epoch's line and says why it stops (rank 0; the writing group)."""

    @property
    def saves(self) -> bool:
        """Whether this process calls the checkpoint's capture (every rank: a collective; the writing group)."""

    def epoch(self, num_epochs: int) -> Iterator[CommittedStep]:
        """The steps of the run's current epoch (from where it stands)."""

    def epoch_loss(self) -> float | None:
        """After :meth:`epoch`: its train loss over every process, ``None`` when it stopped before its end."""

    def __enter__(self) -> StepDriver: ...

    def __exit__(self, *exc: object) -> None: ...


class TrainingRun:
    """The running part of :class:`~ddpkit.TrainLoop` (its base class; see the module docstring)."""

    # Set by TrainLoop.__init__:
    model: nn.Module
    train_loader: DataLoader[Any]
    validation_loader: DataLoader[Any] | None
    test_loader: DataLoader[Any] | None
    optimizer: torch.optim.Optimizer
    device: torch.device
    plugin: DDPPlugin
    checkpoint_dir: Path | None
    checkpoint_every: int | None
    seed: int
    progress: bool
    global_batch: GlobalBatch | None
    preemption: PreemptionHandler
    callbacks_handler: CallbacksHandler
    state: RunState
    ddp_handler: DDPHandler | None
    ddp_model: nn.Module | None
    step_times: list[float]
    recipe: Recipe
    fault_tolerance: TorchFT | None

    def __init__(self) -> None:
        self._epochs: TrainingEpochs | None = None  # the training loader's epochs as steps, once set up
        self._forward_model: nn.Module | None = None  # what training_step gets: the DDP model, maybe compiled
        self._original_loaders: dict[str, DataLoader[Any] | None] = {}
        self._forward_calls = 0

    def batch_to_device(self, batch: Any) -> Any:
        """A batch on the loop's device (``TrainLoop``'s, or a user's override)."""
        raise NotImplementedError

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """A batch's loss (``TrainLoop``'s, or a user's override)."""
        raise NotImplementedError

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(predictions, targets)`` of a batch (``TrainLoop``'s, or a user's override)."""
        raise NotImplementedError

    def evaluate(self, loader: DataLoader[Any] | None = None) -> dict[str, float]:
        """Metrics of ``loader`` on every sample once (``TrainLoop``'s)."""
        raise NotImplementedError

    def _predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`predict_step` in the loop's precision; floating predictions come back as float32."""
        with self.recipe.autocast(self.device):
            predictions, targets = self.predict_step(model, batch)
        if predictions.is_floating_point() and predictions.dtype != torch.float64:
            predictions = predictions.float()
        return predictions, targets

    def _end_epoch_recipe(self) -> None:
        """The epoch's learning rate and skipped steps into :attr:`history`, then a per-epoch scheduler's step."""
        if self.recipe.scheduler is not None:
            self.state.history["lr"].append(
                self.state.step_metrics.get("lr", self.recipe.learning_rate(self.optimizer))
            )
        if self.recipe.scaler is not None:
            self.state.history["skipped_steps"].append(float(self.state.skipped_steps))
        self.recipe.after_epoch(self.state.history)

    def _setup(self) -> nn.Module:
        """Place the model, shard the loaders, wrap in DDP (once)."""
        self.model.to(self.device)
        if self.ddp_handler is None:
            self.ddp_handler = DDPHandler(self)
            self.ddp_handler.add_distributed_samplers(get_world_size(), get_rank())
            if is_distributed():  # the loaders ddpkit rebuilt (a user's own keep their worker_init_fn)
                loaders = ((getattr(self, name), old) for name, old in self._original_loaders.items())
                dump_worker_stacks_in_hang_reports(new for new, old in loaders if new is not None and new is not old)
            sampler = self.ddp_handler.samplers.get("train_loader")
            source = epoch_source(self.train_loader, sampler)
            # With fault tolerance the global batch is dealt per step over the quorum, not by the sampler.
            steps = self.global_batch if self.fault_tolerance is None else None
            self._epochs = TrainingEpochs(source, steps, get_world_size())
        if self.ddp_model is None:
            if is_distributed():
                device_ids = [self.device.index or 0] if self.device.type == "cuda" else None
                self.ddp_model = self.plugin.configure_ddp(self.model, device_ids)
            else:
                self.ddp_model = self.model
            self.recipe.bind(self.optimizer, self.device)
            self._forward_model = self.recipe.compiled(self.ddp_model)
            if self.ddp_model is not self.model:
                self._forward_model.register_forward_pre_hook(self._count_forward)
            self.plugin.on_after_setup_optimizers(self)
        return self.ddp_model

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_calls += 1

    # --- the epoch runner ----------------------------------------------------------------------------

    def _run_epochs(self, driver: StepDriver, num_epochs: int) -> dict[str, list[float]]:
        """Train until ``num_epochs`` epochs are done (or a callback stops it) with ``driver``'s steps."""
        self.callbacks_handler.execute("on_train_begin")
        with self.preemption.watching(self.checkpoint_dir is not None), driver:
            while self.state.epoch < num_epochs and not self.state.should_stop:
                self.callbacks_handler.execute("on_epoch_begin")
                for step in driver.epoch(num_epochs):
                    self._take_step(step, driver)
                loss = driver.epoch_loss()
                if loss is not None:
                    self._end_epoch(loss, num_epochs, driver)
        self.callbacks_handler.execute("on_train_end")
        return dict(self.state.history)

    def _take_step(self, step: CommittedStep, driver: StepDriver) -> None:
        """The optimizer step of ``step``, then ``on_batch_end``, SLURM's signals and a checkpoint every
        ``checkpoint_every`` steps."""
        state = self.state
        lr = self.recipe.learning_rate(self.optimizer)
        outcome = self.recipe.optimizer_step(self.optimizer, self.model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {"lr": lr} if self.recipe.scheduler is not None else {}
        metrics.update(step.metrics)
        if outcome.grad_norm is not None:
            metrics["grad_norm"] = outcome.grad_norm
        if step.sums is None:
            state.end_step(outcome.taken, **metrics)
        else:
            state.count_step(step.sums, outcome.taken, **metrics)
        self.recipe.after_step(outcome)
        self.callbacks_handler.execute("on_batch_end")
        flags = step.flags
        signum = self.preemption.agreed_signal() if flags is None else self.preemption.signal_of(flags)
        if signum:  # SLURM's warning or stop reached some rank or group
            if driver.saves:
                self._save_checkpoint(step.position)
            self.preemption.stop(signum, state.global_step, str(self.checkpoint_dir), leader=driver.leader)
        elif driver.saves and self._checkpoint_due():
            self._save_checkpoint(step.position)

    def _checkpoint_due(self) -> bool:
        """Whether the step just taken is one of every ``checkpoint_every`` (with a ``checkpoint_dir``)."""
        every = self.checkpoint_every
        return bool(every and self.checkpoint_dir is not None and self.state.global_step % every == 0)

    def _end_epoch(self, loss: float, num_epochs: int, driver: StepDriver) -> None:
        """The epoch's train loss, validation, schedule and line, ``on_epoch_end``, then its checkpoint."""
        self.state.history["train_loss"].append(loss)
        metrics = self.evaluate(self.validation_loader) if self.validation_loader is not None else {}
        for name, value in metrics.items():
            self.state.history[f"validation_{name}"].append(value)
        self._end_epoch_recipe()
        if driver.leader:
            tqdm.write(line := driver.prefix + epoch_line(self.state.epoch, num_epochs, loss, metrics, self.step_times))
            log.info(line)
        self.callbacks_handler.execute("on_epoch_end")
        self.state.epoch += 1
        if self.checkpoint_dir is not None and driver.saves:
            self._save_checkpoint(position=0)

    # --- DDP's step driver ---------------------------------------------------------------------------

    def _train_epoch(
        self, model: nn.Module, accumulation: int, num_epochs: int
    ) -> Generator[CommittedStep, None, float]:
        """DDP's steps of the current epoch (:class:`DDPSteps`); returns the epoch's train loss over all ranks."""
        model.train()
        synced = isinstance(model, DistributedDataParallel)
        assert self._epochs is not None
        forward = self._forward_model if self._forward_model is not None else model
        position = self.state.begin_epoch()
        steps = self._epochs.begin(position, accumulation, self.seed, self.state.epoch)
        done = position // self._epochs.entries_per_round
        source = self._epochs.source
        count = source.batch_count()
        bar = tqdm(
            source.training_batches(), total=None if count is None else done + count, initial=done, unit="batch",
            leave=False, desc=f"epoch {self.state.epoch + 1}/{num_epochs}",
            disable=not (self.progress and get_rank() == 0),
        )  # fmt: skip
        busy, previous, batches = 0.0, time.perf_counter(), 0
        for index, (batch, weight, last) in enumerate(bar):
            batch = self.batch_to_device(batch)
            ends_step = steps.ends_step(index) or last
            if (seed := steps.batch_seed(index)) is not None:
                reseed_torch(seed)
            # DDP decides at the forward whether this backward all-reduces: both go inside.
            gradient_sync = contextlib.nullcontext() if ends_step else self.plugin.block_backward_sync(model)
            with gradient_sync:
                calls = self._forward_calls
                with self.recipe.autocast(self.device):
                    loss = self.training_step(forward, batch)
                busy += time.perf_counter() - previous  # loading and forward: before this step's all-reduce
                if synced and ends_step and self._forward_calls == calls:
                    raise skipped_model_error(type(self).training_step, self.state, done + index)
                self.recipe.backward(loss * weight / steps.divisor(index))
            self.state.add_batch(float(loss.detach()), batch_length(batch) * weight)  # a stream's padding: 0 items
            if ends_step:
                yield CommittedStep(steps.position_after(index))
            previous, batches = time.perf_counter(), batches + 1
        if steps.final_step:  # a last, smaller step of a global batch: not every rank had a batch in it
            average_gradients(self.model.parameters())
            yield CommittedStep(steps.end_position())
        per_rank = mp_sync(torch.cat([self.state.epoch_sums, torch.tensor([busy / max(1, batches)]).double()]))
        per_rank = per_rank.view(-1, 3)
        summed, self.step_times = per_rank[:, :2].sum(0), (1000 * per_rank[:, 2]).tolist() if synced else []
        return float(summed[0] / summed[1]) if float(summed[1]) else float("nan")

    def _save_checkpoint(self, position: int) -> None:
        """Write a :class:`~ddpkit.training.TrainState` after ``position`` entries of this epoch (every rank)."""
        assert self.checkpoint_dir is not None
        self._capture(position).write(self.checkpoint_dir / CHECKPOINT_FILE)

    def _capture(self, position: int) -> TrainState:
        """The run after ``position`` entries of this epoch: a checkpoint's content, and what a fault-tolerant
        replica group hands a recovering peer (every rank calls it)."""
        assert self._epochs is not None
        return TrainState.capture(
            self.state, position, self._epochs, model=self.model.state_dict(),
            optimizer=self.plugin.optimizer_state(self.optimizer), callbacks=self.callbacks_handler.state_dicts(),
            seed=self.seed, recipe=self.recipe.state_dict(),
        )  # fmt: skip

    def _resume(self) -> bool:
        """Go on from the checkpoint in :attr:`checkpoint_dir`, if there is one (every rank); whether there was."""
        path = self.checkpoint_dir / CHECKPOINT_FILE if self.checkpoint_dir is not None else None
        if path is None or not path.exists():
            return False
        self._restore(TrainState.load(path, map_location=self.device))
        return True

    def _restore(self, saved: TrainState) -> None:
        """Put the run where ``saved`` was (a checkpoint, or a healthy replica group's state; every rank)."""
        assert self._epochs is not None
        self.model.load_state_dict(saved.model)
        self.optimizer.load_state_dict(saved.optimizer)
        self.callbacks_handler.load_state_dicts(saved.callbacks)
        self.recipe.load_state_dict(saved.recipe)
        saved.restore(self.state, self._epochs, keeps_steps=self.global_batch is not None)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (to :meth:`fit_distributed`'s workers) without the sharding and DDP wrapper of its set-up."""
        state = {**self.__dict__, **self._original_loaders, "ddp_handler": None, "ddp_model": None, "_epochs": None}
        state["_forward_model"] = None
        if self.ddp_handler is not None and self.ddp_handler.callback is not None:
            state["callbacks_handler"] = handler = copy.copy(self.callbacks_handler)
            handler.callbacks = [c for c in handler.callbacks if c is not self.ddp_handler.callback]
        return state


class DDPSteps:
    """DDP's step driver: every rank its shard of each batch, DDP's all-reduce in the backward of a step's
    last batch (``accumulation`` batches per step, or the global batch's)."""

    prefix = ""
    saves = True  # every rank: the checkpoint's capture gathers every rank's random state (rank 0 writes)

    def __init__(self, run: TrainingRun, model: nn.Module, accumulation: int) -> None:
        self.run, self.model, self.accumulation = run, model, accumulation
        self._loss: float | None = None

    @property
    def leader(self) -> bool:
        return get_rank() == 0

    def __enter__(self) -> DDPSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def epoch(self, num_epochs: int) -> Generator[CommittedStep, None, None]:
        self._loss = None
        self._loss = yield from self.run._train_epoch(self.model, self.accumulation, num_epochs)

    def epoch_loss(self) -> float | None:
        return self._loss
