"""What a step driver hands the epoch runner (``_run.TrainingRun``): each optimizer step as a :class:`Step` of
:class:`Batch` es, then a :class:`CommittedStep`; and what a driver is (:class:`StepDriver`).

Two drivers exist: DDP's (``_ddp_steps.DDPSteps``) and a fault-tolerant replica group's
(``_fault_tolerant.FaultTolerantSteps``). What they share is the runner's; a driver says only which batches this
rank's steps hold and how their gradients are reduced and committed.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

__all__ = [
    "Batch",
    "Budget",
    "CommittedStep",
    "EpochTotals",
    "LossSums",
    "NotCommitted",
    "Step",
    "StepDriver",
    "peak_memory",
]


class _Where(Protocol):
    """Where a run stands (a ``RunState``)."""

    epoch: int
    global_step: int
    should_stop: bool


@dataclass(frozen=True)
class Budget:
    """How long a ``fit`` trains: until ``num_epochs`` epochs or ``max_steps`` optimizer steps (counted from the
    run's first, a resumed run's included) are done, whichever comes first (``None``: no bound of that kind), or
    until a callback sets ``should_stop``.

    Raises:
        ValueError: neither bound, or one below 1.
    """

    num_epochs: int | None
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.num_epochs is None and self.max_steps is None:
            raise ValueError("fit needs num_epochs or max_steps (or both: it stops at whichever comes first)")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs={self.num_epochs} must be >= 1 (or None)")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps} must be >= 1 optimizer steps (or None)")

    def done(self, state: _Where) -> bool:
        """Whether the run stops where ``state`` is (checked after each optimizer step and each epoch)."""
        return (
            state.should_stop
            or (self.num_epochs is not None and state.epoch >= self.num_epochs)
            or (self.max_steps is not None and state.global_step >= self.max_steps)
        )

    def epoch_text(self, epoch: int) -> str:
        """``epoch  3/10`` (``epoch`` 0-based), ``epoch  3`` without ``num_epochs``."""
        return f"epoch {epoch + 1:>2}" + (f"/{self.num_epochs}" if self.num_epochs is not None else "")


@dataclass
class Batch:
    """One loader batch of a step, as a driver hands it to the runner's per-batch body.

    Attributes:
        data: the batch as the loader gave it (the body moves it to the device).
        scale: what its loss (a mean over its items) is multiplied by before the backward pass.
        weight: what its sample count is multiplied by in the loss sums (0: a batch that counts nothing, run
            only because every rank must run as many: its gradients are zeros and it changes no buffer).
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


class LossSums:
    """One rank's loss sum and item count in an optimizer step, kept as its batches' mean losses (tensors left on
    their device) and item counts, and summed only when asked for: counting a batch runs no tensor operation."""

    __slots__ = ("_tensor", "host_loss", "items", "losses", "tokens")

    def __init__(self) -> None:
        #: ``(mean loss, items)`` of each counted batch (the loss detached, on its device).
        self.losses: list[tuple[torch.Tensor, float]] = []
        #: Items counted, in all.
        self.items = 0.0
        #: Tokens counted, in all (a tensor on the device when the loop's ``tokens_fn`` gives tensors).
        self.tokens: float | torch.Tensor = 0.0
        #: A loss sum already on the host, besides :attr:`losses` (:meth:`summed`'s).
        self.host_loss = 0.0
        self._tensor: torch.Tensor | None = None

    def add(self, mean_loss: torch.Tensor, items: float, tokens: float | torch.Tensor = 0.0) -> None:
        """Count a batch of ``items`` items and ``tokens`` tokens whose mean loss was ``mean_loss`` (a batch of
        no items adds nothing: its loss, nan perhaps, is not summed)."""
        if items:
            self.losses.append((mean_loss.detach(), items))
        self.items += items
        if not isinstance(tokens, float) or tokens:
            self.tokens = self.tokens + tokens
        self._tensor = None

    @classmethod
    def summed(cls, loss_sum: float, items: float, tokens: float = 0.0) -> LossSums:
        """Sums already made (every replica group's in a fault-tolerant step, which rode with its gradients): a
        loss sum of ``loss_sum`` over ``items`` items and ``tokens`` tokens, on the CPU."""
        sums = cls()
        sums.host_loss, sums.items, sums.tokens = loss_sum if items else 0.0, items, tokens
        return sums

    def host_sums(self) -> list[float]:
        """The loss sum, the item count and the tokens, as numbers on the host: one read of the device (the losses
        and a tokens tensor stacked), or none without a batch."""
        tensors = [loss for loss, _ in self.losses]
        counted = isinstance(self.tokens, torch.Tensor)
        if isinstance(self.tokens, torch.Tensor):
            on = self.tokens.reshape(())  # 0-d, like the losses
            tensors.append(on.to(tensors[0].device) if tensors else on)
        values = torch.stack(tensors).tolist() if len(tensors) > 1 else [tensor.item() for tensor in tensors]
        tokens = values.pop() if counted else self.tokens
        loss_sum = math.fsum([self.host_loss, *(value * items for value, (_, items) in zip(values, self.losses,
                                                                                            strict=True))])  # fmt: skip
        return [loss_sum, self.items, float(tokens)]

    def add_loss_to(self, total: torch.Tensor) -> None:
        """Add the loss sum to ``total`` (a 0-d float64 tensor on the losses' device), in place: one tensor
        operation a batch."""
        for loss, items in self.losses:
            total.add_(loss, alpha=items)
        if self.host_loss:
            total.add_(self.host_loss)

    def tensor(self) -> torch.Tensor:
        """``(2,)`` float64: the loss sum and the item count, on the losses' device (CPU without a batch); made
        once, when first asked for (nothing is read back to the host)."""
        if self._tensor is None:
            if not self.losses:
                self._tensor = torch.tensor([self.host_loss, self.items], dtype=torch.float64)
            else:
                total = torch.zeros(2, dtype=torch.float64, device=self.losses[0][0].device)
                self.add_loss_to(total[0])
                total[1].fill_(self.items)  # a kernel with the number as its argument: no copy, no wait
                self._tensor = total
        return self._tensor


class Step:
    """One optimizer step in the making: the batches a driver hands the runner, then its commit.

    The runner trains every batch :meth:`batches` yields (``TrainingRun.train_batch``), counting each into
    :attr:`counted`, :attr:`busy` and :attr:`trained`, then calls :meth:`commit`. A driver that deals the step
    again (another quorum) calls :meth:`restart` before yielding the new batches.
    """

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """Forget what was counted."""
        #: The loss sums of its batches on this rank.
        self.counted = LossSums()
        #: Seconds of loading and forward of its batches (before the step's all-reduce), and their number.
        self.busy, self.trained = 0.0, 0

    def count(self, mean_loss: torch.Tensor, items: float, seconds: float, tokens: float | torch.Tensor = 0.0) -> None:
        """Count a batch of ``items`` items (and ``tokens`` tokens) whose mean loss was ``mean_loss`` (a tensor, left
        on its device: nothing is read back to the host), loaded and run in ``seconds``."""
        self.counted.add(mean_loss, items, tokens)
        self.busy, self.trained = self.busy + seconds, self.trained + 1

    def take_counts(self, other: Step) -> None:
        """Count what ``other`` counted as this step's (a rank's last batches, trained in the step before)."""
        self.counted = other.counted

    @property
    def sums(self) -> torch.Tensor:
        """``(2,)`` float64: this rank's loss sum and sample count in the step, on the device of its losses (CPU
        when it counted no batch)."""
        return self.counted.tensor()

    def batches(self) -> Iterator[Batch]:
        """The step's batches on this rank."""
        raise NotImplementedError

    def commit(self) -> CommittedStep | NotCommitted:
        """After its batches: the step with its gradients reduced, or why there is no optimizer step now
        (:class:`NotCommitted`). It may put the run where another process was (a fault-tolerant group that took
        a peer's state): the runner then begins that epoch."""
        raise NotImplementedError


class NotCommitted(Enum):
    """Why a step's :meth:`~Step.commit` gave no optimizer step (the runner takes none, and goes on)."""

    #: The step was not committed (a quorum that failed, or the job's first, which trains nothing): the driver
    #: deals it again, to the next quorum.
    AGAIN = "again"
    #: Nothing to commit yet: the rank's last batches of a global batch, whose gradients the step that follows
    #: (the global batch's final, smaller step) averages and commits with its own.
    DEFERRED = "deferred"


@dataclass
class CommittedStep:
    """An optimizer step whose gradients are ready: averaged over every rank (DDP) or every replica group of the
    step's quorum, and committed. The epoch runner takes the optimizer step and what follows.

    Attributes:
        position: entries of the epoch's global order done once this step is taken.
        sums: this rank's loss sum and item count in the step (``loop.step_loss``).
        job_sums: every replica group's, when the driver has them without a collective (fault tolerance: they
            rode with the gradients): the epoch's totals count them. ``None``: the epoch counts :attr:`sums`,
            and the driver sums the ranks' at the epoch's end.
        signal: SLURM's signal that some process received (0: none), the same in every process.
        metrics: what the step measured besides its loss (``replica_groups``), for ``step_metrics``.
    """

    position: int
    sums: LossSums
    signal: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    job_sums: LossSums | None = None


@dataclass
class EpochTotals:
    """What an epoch's line and history say besides validation, over every process that trained it.

    Attributes:
        loss: the epoch's train loss (nan without items).
        items: items trained in its steps since it began or resumed in this run.
        peak_memory: each process's peak memory in bytes, in the order of the loop's ``step_times`` (ranks 0, 1,
            ..., or the driver's ``timed`` names): ``torch.cuda.max_memory_allocated`` on a GPU, the process's
            peak resident set size on the CPU.
        tokens: tokens trained in its steps, as ``items`` (the loop's ``tokens_fn``; ``None`` without one).
    """

    loss: float
    items: float
    peak_memory: list[int]
    tokens: float | None = None


def peak_memory(device: torch.device) -> int:
    """This process's peak memory in bytes so far: ``torch.cuda.max_memory_allocated(device)`` on a CUDA device,
    else the process's peak resident set size (``getrusage``; 0 where the platform has none). Reads nothing from
    the device."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


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

    def epoch(self, position: int, budget: Budget) -> Iterator[Step]:
        """The steps of the run's current epoch from entry ``position`` on."""

    def epoch_totals(self) -> EpochTotals:
        """After :meth:`epoch`: its train loss, items and each process's time per batch and peak memory (every
        process calls it: a driver may gather them); sets the loop's ``step_times``."""

    def gathered(self, position: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """For a checkpoint after ``position`` entries of the epoch: the random states that it keeps, by rank, and
        every process's loss sums in the epoch's steps since it began or resumed (``(2,)`` float64)."""

    def __enter__(self) -> StepDriver: ...

    def __exit__(self, *exc: object) -> None: ...
