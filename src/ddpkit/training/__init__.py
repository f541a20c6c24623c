"""Training: :class:`~ddpkit.TrainLoop` and what it owns.

``loop`` (what a user sees of ``TrainLoop``), ``run`` (its set-up, epochs and
optimizer steps), ``state`` (the run state it owns, and the checkpoint made of
it), ``steps`` (which batches end an optimizer step), ``new_processes``
(``fit_distributed``), ``preemption`` (SLURM's signals).
"""

from __future__ import annotations

from ddpkit.training.loop import TrainLoop
from ddpkit.training.preemption import Preempted, PreemptionHandler
from ddpkit.training.state import RunState, TrainState

__all__ = ["Preempted", "PreemptionHandler", "RunState", "TrainLoop", "TrainState"]
