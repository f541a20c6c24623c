"""How a ``TrainLoop`` runs: its set-up, the epoch runner and its per-batch body, its checkpoints.

``TrainLoop`` (``_loop.py``) holds what a user sees (arguments, the steps to
override, ``fit``, ``evaluate``) and owns a :class:`TrainingRun`, which does
what happens in between and reads the loop through ``_trains.Trains`` (its
checkpoints are in ``_run_checkpoints``). Everything that changes while it
trains is in one :class:`~ddpkit.training.RunState`.

One epoch runner (:meth:`TrainingRun.run_epochs`) serves every way of training: the epochs, callbacks, the
per-batch body (reseed, device, precision, ``training_step``, backward, loss sums, times), the progress bar,
preemption, the optimizer step and what follows it (step metrics, ``on_batch_end``, checkpoints every N steps),
the epoch's end (train loss, validation, schedule, its line, checkpoint). A :class:`StepDriver` says what differs:
which batches each of this process's optimizer steps holds (a :class:`Step` of :class:`Batch`) and how their
gradients are reduced and committed: DDP's (``_ddp_steps.DDPSteps``: each rank its shard of each batch) or a
fault-tolerant replica group's (``_fault_tolerant.FaultTolerantSteps``: each step's items dealt over the quorum).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from ddpkit.batches import batch_length
from ddpkit.ddp_handler import LOADER_ATTRIBUTES, DDPHandler
from ddpkit.hangs._stacks import dump_worker_stacks_in_hang_reports
from ddpkit.process_group import ensure_dist_connection, get_rank, get_world_size, is_distributed
from ddpkit.process_group._seeding import reseed_torch
from ddpkit.training._async_save import AsyncWrites
from ddpkit.training._counting import CountsNothing, tokens_of
from ddpkit.training._default_steps import returned_loss, returned_prediction
from ddpkit.training._driver import Batch, Budget, CommittedStep, EpochTotals, Step, StepDriver
from ddpkit.training._evaluation import predict_in_order
from ddpkit.training._messages import (
    epoch_line,
    evaluation_line,
    skipped_model_error,
    step_name,
    stop_line,
)
from ddpkit.training._run_checkpoints import RunCheckpoints
from ddpkit.training._sources import epoch_source
from ddpkit.training._steps import GlobalBatch, TrainingEpochs
from ddpkit.training._trains import Trains

__all__ = ["TrainingRun"]

log = logging.getLogger(__name__)
_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds nothing


class TrainingRun(RunCheckpoints):
    """How a ``TrainLoop`` trains (the loop owns one; see the module docstring): its set-up, the epoch runner and
    its per-batch body, checkpoints. What it makes in set-up lives here, except what users see on the loop."""

    def __init__(self, loop: Trains) -> None:
        self.loop = loop
        #: The loaders the user gave (set-up may rebuild them: sharded; those go to new processes).
        self.original_loaders = {name: getattr(loop, name) for name, _ in LOADER_ATTRIBUTES}
        self._epochs: TrainingEpochs | None = None  # the training loader's epochs as steps, once set up
        self._forward_model: nn.Module | None = None  # what training_step gets: the DDP model, maybe compiled
        self._forward_calls = 0
        self._counting = False  # whether forwards are counted (a fit with a process group)
        self._driver: StepDriver | None = None  # while it trains
        self._budget = Budget(1)  # the fit's, while it trains
        self._evaluated: tuple[int, dict[str, float]] | None = None  # (global step, metrics) of the last evaluation
        self._writes = AsyncWrites()  # checkpoint_async's writes

    def predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loop's ``predict_step`` in its precision; floating predictions come back as float32."""
        with self.loop.recipe.autocast(self.loop.device):
            predictions, targets = returned_prediction(
                self.loop.predict_step(model, batch), lambda: step_name(self.loop, "predict_step")
            )
        if predictions.is_floating_point() and predictions.dtype != torch.float64:
            predictions = predictions.float()
        return predictions, targets

    def predict_split(self, loader: DataLoader[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(predictions, targets)`` of every item of ``loader``'s split once, in its order (every rank)."""
        ensure_dist_connection()
        self.loop.model.to(self.loop.device)
        together = self.loop.plugin.forwards_together and is_distributed()  # a sharded model's forwards
        return predict_in_order(self.loop.model, loader, self.predict, self.loop.batch_to_device, together)

    def _end_epoch_recipe(self) -> None:
        """The epoch's learning rate and skipped steps into the history, then a per-epoch scheduler's step."""
        recipe, state = self.loop.recipe, self.loop.state
        if recipe.scheduler is not None:
            state.history["lr"].append(state.step_metrics.get("lr", recipe.learning_rate(self.loop.optimizer)))
        if recipe.scaler is not None:
            state.history["skipped_steps"].append(float(state.skipped_steps))
        recipe.after_epoch(state.history)

    def setup(self, global_batch: GlobalBatch | None) -> nn.Module:
        """Place the model, shard the loaders, wrap in DDP (once); the model to train (DDP's, or the model).
        ``global_batch``: the steps the sampler's shards make (``None``: the driver deals each step itself)."""
        loop = self.loop
        loop.model.to(loop.device)
        if loop.ddp_handler is None:
            loop.ddp_handler = DDPHandler(loop)
            loop.ddp_handler.add_distributed_samplers(get_world_size(), get_rank())
            if is_distributed():  # the loaders ddpkit rebuilt (a user's own keep their worker_init_fn)
                loaders = ((getattr(loop, name), old) for name, old in self.original_loaders.items())
                dump_worker_stacks_in_hang_reports(new for new, old in loaders if new is not None and new is not old)
            sampler = loop.ddp_handler.samplers.get("train_loader")
            self._epochs = TrainingEpochs(epoch_source(loop.train_loader, sampler), global_batch, get_world_size())
        if loop.ddp_model is None:
            loop.plugin.precision = loop.recipe.precision  # what FSDPPlugin shards in
            if is_distributed():
                device_ids = [loop.device.index or 0] if loop.device.type == "cuda" else None
                loop.ddp_model = loop.plugin.configure_ddp(loop.model, device_ids)
            else:
                loop.plugin.apply_activation_checkpointing(loop.model)  # configure_ddp does it with a process group
                loop.ddp_model = loop.model
            loop.recipe.bind(loop.optimizer, loop.device, sharded=loop.plugin.forwards_together and is_distributed())
            self._forward_model = loop.recipe.compiled(loop.ddp_model)
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

    def run_epochs(self, driver: StepDriver, budget: Budget) -> dict[str, list[float]]:
        """Train until ``budget`` is spent (or a callback stops it) with ``driver``'s steps."""
        loop = self.loop
        loop.callbacks_handler.execute("on_train_begin")
        self._driver, self._budget, self._evaluated = driver, budget, None
        # With a process group, each forward of the model is counted (a rank whose training_step skips it would
        # skip the collectives the other ranks wait in): the wrapper's (DDP's), or the model's own when the plugin
        # shards it in place (FSDP: calling loop.model is as good); the hook goes with the run.
        counted = loop.model if loop.ddp_model is loop.model else self.forward_model
        counting = counted.register_forward_pre_hook(self._count_forward) if is_distributed() else None
        self._counting = counting is not None
        try:
            with loop.preemption.watching(loop.checkpoint_dir is not None, driver.forwarded), driver:
                while not budget.done(loop.state):
                    loop.callbacks_handler.execute("on_epoch_begin")
                    self._run_epoch(driver)
                self._writes.finish()  # the last checkpoint is whole on disk when fit returns
        finally:
            self._writes.wait()  # a stop or a failure: rank 0's write under way still completes
            self._driver, self._counting = None, False
            if counting is not None:
                counting.remove()
        loop.callbacks_handler.execute("on_train_end")
        return dict(loop.state.history)

    def _run_epoch(self, driver: StepDriver) -> None:
        """The current epoch's steps from where it stands, then its end; or, when the budget runs out after a step
        that does not end the epoch (``max_steps``, a callback's ``should_stop``), the run's end there (the step's
        checkpoint is written). A commit that puts the run in another epoch (a fault-tolerant group that took a
        peer's state) begins that one: ``on_epoch_begin`` again."""
        loop, state, budget = self.loop, self.loop.state, self._budget
        epoch, start = state.epoch, state.begin_epoch()
        began = time.perf_counter()
        self.forward_model.train()
        bar: tqdm[Any] | None = None
        stopped = False
        try:
            previous = time.perf_counter()  # each batch's time: from the last one's end (or the last step's)
            for step in driver.epoch(start, budget):
                if budget.done(state):  # spent after a step that left some of the epoch: the run ends there
                    stopped = True
                    break
                for batch in step.batches():
                    self.train_batch(batch, step, previous)
                    previous = time.perf_counter()
                self._writes.staged()  # an asynchronous checkpoint's copy of the weights is made before they change
                committed = step.commit()
                if state.epoch != epoch:  # the commit put the run in another epoch: it begins here
                    if bar is not None:
                        bar.close()
                    epoch, start, bar = state.epoch, 0, None
                    loop.callbacks_handler.execute("on_epoch_begin")
                if isinstance(committed, CommittedStep):  # else NotCommitted: again, or deferred to the next step
                    self._take_step(committed, driver)
                    bar = self._progress(bar, driver, start, committed.position)
                previous = time.perf_counter()
        finally:
            if bar is not None:
                bar.close()
        self._writes.staged()  # before the epoch's end (its callbacks may change the weights)
        totals = driver.epoch_totals()  # its one read of the device: the work queued is done when it returns
        if stopped:
            self._stop_in_epoch(totals, time.perf_counter() - began, driver)
        else:
            self._end_epoch(totals, time.perf_counter() - began, driver)

    def train_batch(self, batch: Batch, step: Step, began: float) -> None:
        """The per-batch body: reseed, move to the device, ``training_step`` in the run's precision, backward of
        its scaled loss (DDP's all-reduce only in a ``synced`` batch), counted into ``step`` with the seconds
        since ``began`` (loading and forward). A batch that counts nothing (weight 0: a rank with no item left in
        a step where every rank must run as many forwards, a sharded model's, or a stream's padding) runs the
        same, but its backward starts from the model's outputs with zero gradients, not from its loss: the
        gradients it adds are exactly zero whatever the loss is (inf or nan too), and every buffer it changed
        (BatchNorm's running statistics) is put back."""
        loop = self.loop
        if batch.seed is not None:
            reseed_torch(batch.seed)
        data = loop.batch_to_device(batch.data)
        # DDP decides at the forward whether this backward all-reduces: both go inside.
        model = loop.ddp_model if loop.ddp_model is not None else loop.model
        nothing = CountsNothing(self.forward_model, loop.model) if batch.weight == 0.0 else None
        with nothing or _NO_CONTEXT, _NO_CONTEXT if batch.synced else loop.plugin.block_backward_sync(model):
            calls = self._forward_calls
            with loop.recipe.autocast(loop.device):
                loss = loop.training_step(self.forward_model, data)
                if type(loss) is not torch.Tensor or loss.dim():
                    loss = returned_loss(loss, lambda: step_name(loop, "training_step"))
            seconds = time.perf_counter() - began
            # A batch whose backward synchronises (DDP's all-reduce), or any batch when the plugin's forward is a
            # collective too (FSDP's all-gathers): every rank must have run the model.
            if self._counting and self._forward_calls == calls and (batch.synced or loop.plugin.forwards_together):
                raise skipped_model_error(type(loop).training_step, loop.state, batch.index)
            loop.recipe.backward(loss, batch.scale, None if nothing is None else nothing.outputs)
        tokens = 0.0 if loop.tokens_fn is None else tokens_of(loop.tokens_fn, data, batch.weight)
        step.count(loss, batch_length(data) * batch.weight, seconds, tokens)  # padding: 0 items; no read of the loss

    def _progress(self, bar: tqdm[Any] | None, driver: StepDriver, start: int, position: int) -> tqdm[Any] | None:
        """The epoch's bar (with ``progress``, in the leader) at ``position`` entries of the epoch's order."""
        loop = self.loop
        if bar is None:
            if not (loop.progress and driver.leader):
                return None
            source = self.epochs.source
            bar = tqdm(
                total=source.entry_count(), initial=start, unit="item" if source.items_per_batch else "batch",
                leave=False, desc=f"{driver.prefix}{self._budget.epoch_text(loop.state.epoch).replace('  ', ' ')}",
            )  # fmt: skip
        bar.update(position - bar.n)
        return bar

    def _take_step(self, step: CommittedStep, driver: StepDriver) -> None:
        """The optimizer step of ``step``, then ``on_batch_end``, an evaluation every ``evaluate_every`` steps,
        SLURM's signals, and a checkpoint every ``checkpoint_every`` steps and where the run's budget ends."""
        loop, state, recipe = self.loop, self.loop.state, self.loop.recipe
        metrics: dict[str, float | torch.Tensor] = {}
        if recipe.scheduler is not None:
            metrics["lr"] = recipe.learning_rate(loop.optimizer)
        outcome = recipe.optimizer_step(loop.optimizer, loop.model.parameters())
        loop.optimizer.zero_grad(set_to_none=True)
        metrics.update(step.metrics)
        if outcome.grad_norm is not None:
            metrics["grad_norm"] = outcome.grad_norm
        state.count_step(step.sums, outcome.taken, step.job_sums, **metrics)
        recipe.after_step(outcome)
        loop.callbacks_handler.execute("on_batch_end")
        if loop.evaluate_every is not None and state.global_step % loop.evaluate_every == 0:
            self._evaluate_at_step(driver)
        if step.signal:  # SLURM's warning or stop reached some rank or group
            if driver.saves:
                self._save_checkpoint(step.position)
            loop.preemption.stop(step.signal, state.global_step, str(loop.checkpoint_dir), leader=driver.leader)
        elif driver.saves and self._checkpoint_due():
            self._save_checkpoint(step.position)

    def _checkpoint_due(self) -> bool:
        """Whether the step just taken is one of every ``checkpoint_every`` or the last of the run's budget (with a
        ``checkpoint_dir``)."""
        loop, every = self.loop, self.loop.checkpoint_every
        if loop.checkpoint_dir is None:
            return False
        return bool(every and loop.state.global_step % every == 0) or self._budget.done(loop.state)

    def _evaluate_at_step(self, driver: StepDriver) -> None:
        """Evaluate the validation split after this step (every rank): its metrics into ``history`` as
        ``eval_<name>`` beside ``eval_step``, and a line."""
        loop, state = self.loop, self.loop.state
        metrics = loop.evaluate(loop.validation_loader)
        self._evaluated = (state.global_step, metrics)
        state.history["eval_step"].append(float(state.global_step))
        for name, value in metrics.items():
            state.history[f"eval_{name}"].append(value)
        if driver.leader:
            line = driver.prefix + evaluation_line(state.epoch, state.global_step, metrics)
            tqdm.write(f"{line}\n", end="")
            log.info(line)

    def _stop_in_epoch(self, totals: EpochTotals, seconds: float, driver: StepDriver) -> None:
        """The run's end after a step that left some of the epoch (its checkpoint is written): a line with the
        train loss of the epoch's steps so far; the epoch has not ended (no history entry, no ``on_epoch_end``):
        a resumed run goes on inside it."""
        state = self.loop.state
        speed = totals.items / seconds if seconds > 0 else float("nan")
        if driver.leader:
            line = driver.prefix + stop_line(state, self._budget, totals, speed)
            tqdm.write(f"{line}\n", end="")
            log.info(line)

    def _end_epoch(self, totals: EpochTotals, seconds: float, driver: StepDriver) -> None:
        """The epoch's train loss, throughput and peak memory (``totals`` of its ``seconds`` of training),
        validation, schedule and line, ``on_epoch_end``, then its checkpoint."""
        loop, state = self.loop, self.loop.state
        speed = totals.items / seconds if seconds > 0 else float("nan")
        tokens = None if totals.tokens is None else totals.tokens / seconds if seconds > 0 else float("nan")
        state.history["train_loss"].append(totals.loss)
        metrics: dict[str, float] = {}
        if self._evaluated is not None and self._evaluated[0] == state.global_step:
            metrics = dict(self._evaluated[1])  # evaluated after this epoch's last step already: the same weights
        elif loop.validation_loader is not None:
            metrics = loop.evaluate(loop.validation_loader)
        for name, value in metrics.items():
            state.history[f"validation_{name}"].append(value)
        state.history["items_per_second"].append(speed)
        if tokens is not None:
            state.history["tokens_per_second"].append(tokens)
        state.history["peak_memory_mib"].append(max(totals.peak_memory, default=0) / 2**20)
        self._end_epoch_recipe()
        if driver.leader:
            line = driver.prefix + epoch_line(
                self._budget.epoch_text(state.epoch),
                totals.loss,
                metrics,
                loop.step_times,
                driver.timed,
                speed,
                totals.peak_memory,
                tokens,
            )
            tqdm.write(f"{line}\n", end="")  # one write: other groups' lines may share the stream
            log.info(line)
        loop.callbacks_handler.execute("on_epoch_end")
        state.epoch += 1
        if loop.checkpoint_dir is not None and driver.saves:
            self._save_checkpoint(position=0)

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
