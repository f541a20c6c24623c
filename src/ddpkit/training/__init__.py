"""Training: :class:`~ddpkit.TrainLoop` and what it keeps, raises and takes: its run state and the checkpoints
made of it, SLURM's preemption, the types of its learning-rate schedule and precision arguments, and the
language-model metrics its default steps compute (for a ``predict_step`` of your own)."""

# For maintainers, what the private modules hold: ``_loop`` (what a user sees of ``TrainLoop``), ``_run`` (its set-up
# and the epoch runner: epochs, the per-batch body, the bar, optimizer steps), ``_driver`` (what a step driver hands
# the runner), ``_ddp_steps`` (DDP's step driver), ``_state`` (the run state it owns, and the checkpoint made of it),
# ``_steps`` (which batches end an optimizer step), ``_sources`` (a loader's epochs, map-style or streamed),
# ``_evaluation`` (metrics equal to one process's), ``_new_processes`` (``fit_distributed``), ``_preemption`` (SLURM's
# signals), ``_messages`` (what it prints and raises), ``_recipe`` (learning-rate schedules, mixed precision, gradient
# clipping, compilation), ``_fault_tolerant`` (the step driver of a replica group), ``_ahead`` (its shares through the
# training loader), ``_default_steps`` (the default steps: dict batches, a model's own loss and logits, the
# language-model metrics).

from __future__ import annotations

from ddpkit.training._default_steps import language_model_metrics, language_model_rows
from ddpkit.training._loop import TrainLoop
from ddpkit.training._preemption import Preempted, PreemptionHandler
from ddpkit.training._recipe import Interval, Precision, SchedulerFactory
from ddpkit.training._state import RunState, TrainState

__all__ = [
    "Interval",
    "Precision",
    "Preempted",
    "PreemptionHandler",
    "RunState",
    "SchedulerFactory",
    "TrainLoop",
    "TrainState",
    "language_model_metrics",
    "language_model_rows",
]
