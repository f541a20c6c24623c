"""How a ``TrainLoop`` runs: its set-up, the epoch runner, DDP's step driver, its checkpoints.

``TrainLoop`` (``_loop.py``) holds what a user sees (arguments, the steps to
override, ``fit``, ``evaluate``) and owns a :class:`TrainingRun`, which does
what happens in between and reads the loop through :class:`Trains`. Everything
that changes while it trains is in one :class:`~ddpkit.training.RunState`.

One epoch runner (:meth:`TrainingRun.run_epochs`) serves every way of training: callbacks, preemption, the
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
from ddpkit.ddp_handler import LOADER_ATTRIBUTES, DDPHandler
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

__all__ = ["CommittedStep", "DDPSteps", "StepDriver", "TrainingRun", "Trains"]

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
    #: Whose times the loop's ``step_times`` holds, in order (replica groups); empty: the ranks 0, 1, ...
    timed: list[str]

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


class Trains(Protocol):
    """What a :class:`TrainingRun` reads from the loop that owns it (``TrainLoop``): the user's parts and steps.
    The run writes back only what its set-up makes (``ddp_handler``, ``ddp_model``) and ``step_times``."""

    model: nn.Module
    train_loader: DataLoader[Any]
    validation_loader: DataLoader[Any] | None
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

    def batch_to_device(self, batch: Any) -> Any: ...

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor: ...

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]: ...

    def evaluate(self, loader: DataLoader[Any] | None = None) -> dict[str, float]: ...


class TrainingRun:
    """How a ``TrainLoop`` trains (the loop owns one; see the module docstring): its set-up, the epoch runner,
    DDP's steps, checkpoints. What it makes in set-up lives here, except what users see on the loop."""

    def __init__(self, loop: Trains) -> None:
        self.loop = loop
        #: The loaders the user gave (set-up may rebuild them: sharded; those go to new processes).
        self.original_loaders = {name: getattr(loop, name) for name, _ in LOADER_ATTRIBUTES}
        self._epochs: TrainingEpochs | None = None  # the training loader's epochs as steps, once set up
        self._forward_model: nn.Module | None = None  # what training_step gets: the DDP model, maybe compiled
        self._forward_calls = 0

    def predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loop's ``predict_step`` in its precision; floating predictions come back as float32."""
        with self.loop.recipe.autocast(self.loop.device):
            predictions, targets = self.loop.predict_step(model, batch)
        if predictions.is_floating_point() and predictions.dtype != torch.float64:
            predictions = predictions.float()
        return predictions, targets

    def _end_epoch_recipe(self) -> None:
        """The epoch's learning rate and skipped steps into the history, then a per-epoch scheduler's step."""
        recipe, state = self.loop.recipe, self.loop.state
        if recipe.scheduler is not None:
            state.history["lr"].append(state.step_metrics.get("lr", recipe.learning_rate(self.loop.optimizer)))
        if recipe.scaler is not None:
            state.history["skipped_steps"].append(float(state.skipped_steps))
        recipe.after_epoch(state.history)

    def setup(self) -> nn.Module:
        """Place the model, shard the loaders, wrap in DDP (once); the model to train (DDP's, or the model)."""
        loop = self.loop
        loop.model.to(loop.device)
        if loop.ddp_handler is None:
            loop.ddp_handler = DDPHandler(loop)
            loop.ddp_handler.add_distributed_samplers(get_world_size(), get_rank())
            if is_distributed():  # the loaders ddpkit rebuilt (a user's own keep their worker_init_fn)
                loaders = ((getattr(loop, name), old) for name, old in self.original_loaders.items())
                dump_worker_stacks_in_hang_reports(new for new, old in loaders if new is not None and new is not old)
            sampler = loop.ddp_handler.samplers.get("train_loader")
            source = epoch_source(loop.train_loader, sampler)
            # With fault tolerance the global batch is dealt per step over the quorum, not by the sampler.
            steps = loop.global_batch if loop.fault_tolerance is None else None
            self._epochs = TrainingEpochs(source, steps, get_world_size())
        if loop.ddp_model is None:
            if is_distributed():
                device_ids = [loop.device.index or 0] if loop.device.type == "cuda" else None
                loop.ddp_model = loop.plugin.configure_ddp(loop.model, device_ids)
            else:
                loop.ddp_model = loop.model
            loop.recipe.bind(loop.optimizer, loop.device)
            self._forward_model = loop.recipe.compiled(loop.ddp_model)
            if loop.ddp_model is not loop.model:
                self._forward_model.register_forward_pre_hook(self._count_forward)
            loop.plugin.on_after_setup_optimizers(loop)
        return loop.ddp_model

    @property
    def forward_model(self) -> nn.Module:
        """What ``training_step`` gets: the DDP-wrapped model, compiled with ``compile`` (after set-up)."""
        return self._forward_model if self._forward_model is not None else self.loop.model

    @property
    def epochs(self) -> TrainingEpochs:
        """The training loader's epochs as steps (after set-up)."""
        assert self._epochs is not None, "set up first"
        return self._epochs

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_calls += 1

    # --- the epoch runner ----------------------------------------------------------------------------

    def run_epochs(self, driver: StepDriver, num_epochs: int) -> dict[str, list[float]]:
        """Train until ``num_epochs`` epochs are done (or a callback stops it) with ``driver``'s steps."""
        loop = self.loop
        loop.callbacks_handler.execute("on_train_begin")
        with loop.preemption.watching(loop.checkpoint_dir is not None), driver:
            while loop.state.epoch < num_epochs and not loop.state.should_stop:
                loop.callbacks_handler.execute("on_epoch_begin")
                for step in driver.epoch(num_epochs):
                    self._take_step(step, driver)
                loss = driver.epoch_loss()
                if loss is not None:
                    self._end_epoch(loss, num_epochs, driver)
        loop.callbacks_handler.execute("on_train_end")
        return dict(loop.state.history)

    def _take_step(self, step: CommittedStep, driver: StepDriver) -> None:
        """The optimizer step of ``step``, then ``on_batch_end``, SLURM's signals and a checkpoint every
        ``checkpoint_every`` steps."""
        loop, state, recipe = self.loop, self.loop.state, self.loop.recipe
        lr = recipe.learning_rate(loop.optimizer)
        outcome = recipe.optimizer_step(loop.optimizer, loop.model.parameters())
        loop.optimizer.zero_grad(set_to_none=True)
        metrics = {"lr": lr} if recipe.scheduler is not None else {}
        metrics.update(step.metrics)
        if outcome.grad_norm is not None:
            metrics["grad_norm"] = outcome.grad_norm
        if step.sums is None:
            state.end_step(outcome.taken, **metrics)
        else:
            state.count_step(step.sums, outcome.taken, **metrics)
        recipe.after_step(outcome)
        loop.callbacks_handler.execute("on_batch_end")
        flags = step.flags
        signum = loop.preemption.agreed_signal() if flags is None else loop.preemption.signal_of(flags)
        if signum:  # SLURM's warning or stop reached some rank or group
            if driver.saves:
                self._save_checkpoint(step.position)
            loop.preemption.stop(signum, state.global_step, str(loop.checkpoint_dir), leader=driver.leader)
        elif driver.saves and self._checkpoint_due():
            self._save_checkpoint(step.position)

    def _checkpoint_due(self) -> bool:
        """Whether the step just taken is one of every ``checkpoint_every`` (with a ``checkpoint_dir``)."""
        every = self.loop.checkpoint_every
        return bool(every and self.loop.checkpoint_dir is not None and self.loop.state.global_step % every == 0)

    def _end_epoch(self, loss: float, num_epochs: int, driver: StepDriver) -> None:
        """The epoch's train loss, validation, schedule and line, ``on_epoch_end``, then its checkpoint."""
        loop, state = self.loop, self.loop.state
        state.history["train_loss"].append(loss)
        metrics = loop.evaluate(loop.validation_loader) if loop.validation_loader is not None else {}
        for name, value in metrics.items():
            state.history[f"validation_{name}"].append(value)
        self._end_epoch_recipe()
        if driver.leader:
            line = driver.prefix + epoch_line(state.epoch, num_epochs, loss, metrics, loop.step_times, driver.timed)
            tqdm.write(f"{line}\n", end="")  # one write: other groups' lines may share the stream
            log.info(line)
        loop.callbacks_handler.execute("on_epoch_end")
        state.epoch += 1
        if loop.checkpoint_dir is not None and driver.saves:
            self._save_checkpoint(position=0)

    # --- DDP's step driver ---------------------------------------------------------------------------

    def _train_epoch(
        self, model: nn.Module, accumulation: int, num_epochs: int
    ) -> Generator[CommittedStep, None, float]:
        """DDP's steps of the current epoch (:class:`DDPSteps`); returns the epoch's train loss over all ranks."""
        loop, state, recipe = self.loop, self.loop.state, self.loop.recipe
        model.train()
        synced = isinstance(model, DistributedDataParallel)
        epochs, forward = self.epochs, self._forward_model if self._forward_model is not None else model
        position = state.begin_epoch()
        steps = epochs.begin(position, accumulation, loop.seed, state.epoch)
        done = position // epochs.entries_per_round
        source = epochs.source
        count = source.batch_count()
        bar = tqdm(
            source.training_batches(), total=None if count is None else done + count, initial=done, unit="batch",
            leave=False, desc=f"epoch {state.epoch + 1}/{num_epochs}", disable=not (loop.progress and get_rank() == 0),
        )  # fmt: skip
        busy, previous, batches = 0.0, time.perf_counter(), 0
        for index, (batch, weight, last) in enumerate(bar):
            batch = loop.batch_to_device(batch)
            ends_step = steps.ends_step(index) or last
            if (seed := steps.batch_seed(index)) is not None:
                reseed_torch(seed)
            # DDP decides at the forward whether this backward all-reduces: both go inside.
            gradient_sync = contextlib.nullcontext() if ends_step else loop.plugin.block_backward_sync(model)
            with gradient_sync:
                calls = self._forward_calls
                with recipe.autocast(loop.device):
                    loss = loop.training_step(forward, batch)
                busy += time.perf_counter() - previous  # loading and forward: before this step's all-reduce
                if synced and ends_step and self._forward_calls == calls:
                    raise skipped_model_error(type(loop).training_step, state, done + index)
                recipe.backward(loss * weight / steps.divisor(index))
            state.add_batch(float(loss.detach()), batch_length(batch) * weight)  # a stream's padding: 0 items
            if ends_step:
                yield CommittedStep(steps.position_after(index))
            previous, batches = time.perf_counter(), batches + 1
        if steps.final_step:  # a last, smaller step of a global batch: not every rank had a batch in it
            average_gradients(loop.model.parameters())
            yield CommittedStep(steps.end_position())
        per_rank = mp_sync(torch.cat([state.epoch_sums, torch.tensor([busy / max(1, batches)]).double()]))
        per_rank = per_rank.view(-1, 3)
        summed, loop.step_times = per_rank[:, :2].sum(0), (1000 * per_rank[:, 2]).tolist() if synced else []
        return float(summed[0] / summed[1]) if float(summed[1]) else float("nan")

    # --- checkpoints ---------------------------------------------------------------------------------

    def _save_checkpoint(self, position: int) -> None:
        """Write a :class:`~ddpkit.training.TrainState` after ``position`` entries of this epoch (every rank)."""
        assert self.loop.checkpoint_dir is not None
        self.capture(position).write(self.loop.checkpoint_dir / CHECKPOINT_FILE)

    def capture(self, position: int) -> TrainState:
        """The run after ``position`` entries of this epoch: a checkpoint's content, and what a fault-tolerant
        replica group hands a recovering peer (every rank calls it)."""
        loop = self.loop
        return TrainState.capture(
            loop.state, position, self.epochs, model=loop.model.state_dict(),
            optimizer=loop.plugin.optimizer_state(loop.optimizer), callbacks=loop.callbacks_handler.state_dicts(),
            seed=loop.seed, recipe=loop.recipe.state_dict(), replicated=loop.fault_tolerance is not None,
        )  # fmt: skip

    def resume(self) -> bool:
        """Go on from the checkpoint in the loop's ``checkpoint_dir``, if there is one (every rank); whether
        there was."""
        directory = self.loop.checkpoint_dir
        path = directory / CHECKPOINT_FILE if directory is not None else None
        if path is None or not path.exists():
            return False
        self.restore(TrainState.load(path, map_location=self.loop.device))
        return True

    def restore(self, saved: TrainState) -> None:
        """Put the run where ``saved`` was (a checkpoint, or a healthy replica group's state; every rank)."""
        loop = self.loop
        loop.model.load_state_dict(saved.model)
        loop.optimizer.load_state_dict(saved.optimizer)
        loop.callbacks_handler.load_state_dicts(saved.callbacks)
        loop.recipe.load_state_dict(saved.recipe)
        saved.restore(loop.state, self.epochs, keeps_steps=loop.global_batch is not None,
                      replicated=loop.fault_tolerance is not None)  # fmt: skip

    def pickled(self) -> dict[str, Any]:
        """The loop's ``__getstate__`` (to ``fit_distributed``'s new processes): without this run (made again
        there) and the sharding and DDP wrapper of its set-up; with the loaders the user gave."""
        loop = self.loop
        state = {**vars(loop), **self.original_loaders, "ddp_handler": None, "ddp_model": None}
        del state["_run"]
        if loop.ddp_handler is not None and loop.ddp_handler.callback is not None:
            state["callbacks_handler"] = handler = copy.copy(loop.callbacks_handler)
            handler.callbacks = [c for c in handler.callbacks if c is not loop.ddp_handler.callback]
        return state


class DDPSteps:
    """DDP's step driver: every rank its shard of each batch, DDP's all-reduce in the backward of a step's
    last batch (``accumulation`` batches per step, or the global batch's)."""

    prefix = ""
    saves = True  # every rank: the checkpoint's capture gathers every rank's random state (rank 0 writes)

    def __init__(self, run: TrainingRun, model: nn.Module, accumulation: int) -> None:
        self.run, self.model, self.accumulation = run, model, accumulation
        self.timed: list[str] = []  # the loop's step_times are the ranks', in order
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
