"""What a step driver hands the epoch runner (``_run.TrainingRun``): each optimizer step as a :class:`Step` of
:class:`Batch` es, then a :class:`CommittedStep`; and what a driver is (:class:`StepDriver`).

Two drivers exist: DDP's (``_ddp_steps.DDPSteps``) and a fault-tolerant replica group's
(``_fault_tolerant.FaultTolerantSteps``). What they share is the runner's; a driver says only which batches this
rank's steps hold and how their gradients are reduced and committed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = ["Batch", "CommittedStep", "Step", "StepDriver"]


@dataclass
class Batch:
    """One loader batch of a step, as a driver hands it to the runner's per-batch body.

    Attributes:
        data: the batch as the loader gave it (the body moves it to the device).
        scale: what its loss (a mean over its items) is multiplied by before the backward pass.
        weight: what its sample count is multiplied by in the loss sums (0: padding that does not count).
        seed: the seed of torch's random numbers for it, or ``None`` to run on from the last batch.
        synced: whether its backward runs DDP's all-reduce (a DDP step's last batch); otherwise DDP's
            all-reduce is off for it (``block_backward_sync``).
        index: its number in this rank's epoch (for messages).
    """

    data: Any
    scale: float
    weight: float = 1.0
    seed: int | None = None
    synced: bool = False
    index: int = 0


class Step:
    """One optimizer step in the making: the batches a driver hands the runner, then its commit.

    The runner trains every batch :meth:`batches` yields (``TrainingRun.train_batch``), counting each into
    :attr:`sums`, :attr:`busy` and :attr:`trained`, then calls :meth:`commit`. A driver that deals the step
    again (another quorum) calls :meth:`restart` before yielding the new batches.
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Forget what was counted."""
        #: This rank's loss sum and sample count in the step (:attr:`sums` as a tensor).
        self.loss_sum, self.items = 0.0, 0.0
        #: Seconds of loading and forward of its batches (before the step's all-reduce), and their number.
        self.busy, self.trained = 0.0, 0

    def count(self, mean_loss: float, items: float, seconds: float) -> None:
        """Count a batch of ``items`` items whose mean loss was ``mean_loss``, loaded and run in ``seconds``."""
        self.loss_sum, self.items = self.loss_sum + mean_loss * items, self.items + items
        self.busy, self.trained = self.busy + seconds, self.trained + 1

    @property
    def sums(self) -> torch.Tensor:
        """``(2,)`` float64: this rank's loss sum and sample count in the step."""
        return torch.tensor([self.loss_sum, self.items], dtype=torch.float64)

    def batches(self) -> Iterator[Batch]:
        """The step's batches on this rank."""
        raise NotImplementedError

    def commit(self) -> CommittedStep | None:
        """After its batches: the step with its gradients reduced, or ``None`` when it was not committed (the
        driver does it again). It may put the run where another process was (a fault-tolerant group that took
        a peer's state): the runner then begins that epoch."""
        raise NotImplementedError


@dataclass
class CommittedStep:
    """An optimizer step whose gradients are ready: averaged over every rank (DDP) or every replica group of the
    step's quorum, and committed. The epoch runner takes the optimizer step and what follows.

    Attributes:
        position: entries of the epoch's global order done once this step is taken.
        sums: ``(2,)`` float64: this rank's loss sum and item count in the step.
        signal: SLURM's signal that some process received (0: none), the same in every process.
        metrics: what the step measured besides its loss (``replica_groups``), for ``step_metrics``.
    """

    position: int
    sums: torch.Tensor
    signal: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class StepDriver(Protocol):
    """How a run's steps come to be: the epoch runner's other half (a context manager around the run)."""

    #: Put before the epoch's line (a replica group's name).
    prefix: str
    #: Whose times the loop's ``step_times`` holds, in order (replica groups); empty: the ranks 0, 1, ...
    timed: list[str]
    #: Whether SLURM's signals reach this process through a command of the job's own (a replica group's node
    #: command), not as one of SLURM's tasks (``PreemptionHandler.watching``).
    forwarded: bool

    @property
    def leader(self) -> bool:
        """Whether this process prints the epoch's line and bar and says why it stops (rank 0; the writing
        group's)."""

    @property
    def saves(self) -> bool:
        """Whether this process calls the checkpoint's capture (every rank: a collective; the writing group)."""

    def epoch(self, position: int, num_epochs: int) -> Iterator[Step]:
        """The steps of the run's current epoch from entry ``position`` on."""

    def epoch_loss(self) -> float:
        """After :meth:`epoch`: its train loss over every process; sets the loop's ``step_times``."""

    def gathered(self, position: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """For a checkpoint after ``position`` entries of the epoch: the random states that it keeps, by rank, and
        every process's loss sums in the epoch's steps since it began or resumed (``(2,)`` float64)."""

    def __enter__(self) -> StepDriver: ...

    def __exit__(self, *exc: object) -> None: ...
