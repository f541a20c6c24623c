"""DDP's step driver of a ``TrainLoop`` run: every rank its shard of each batch, DDP's all-reduce in the backward
of a step's last batch (``grad_accumulation`` batches per step, or the global batch's); the epoch runner
(``_run.py``) does the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit.checkpoint import rng_state
from ddpkit.collectives import all_gather_object, mp_sync, sync_ddp
from ddpkit.process_group import get_rank, is_distributed
from ddpkit.training._driver import Batch, Budget, CommittedStep, EpochTotals, NotCommitted, Step, peak_memory
from ddpkit.training._run import TrainingRun
from ddpkit.training._steps import StepPlan, average_gradients

__all__ = ["DDPSteps"]

_Numbered = tuple[int, tuple[Any, float, bool]]  # (index, (batch, weight, last)) of the source's batches


class DDPSteps:
    """DDP's step driver (see the module docstring): ``accumulation`` batches per step, or the global batch's."""

    prefix = ""
    forwarded = False  # each rank is a task of SLURM's, or under torchrun/ddpkit run inside one
    saves = True  # every rank: the checkpoint's capture gathers every rank's random state (rank 0 writes)

    def __init__(self, run: TrainingRun, accumulation: int) -> None:
        run.setup(run.loop.global_batch)
        self.run, self.accumulation = run, accumulation
        self.timed: list[str] = []  # the loop's step_times are the ranks', in order
        self._busy, self._batches = 0.0, 0

    @property
    def leader(self) -> bool:
        return get_rank() == 0

    def __enter__(self) -> DDPSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def epoch(self, position: int, budget: Budget) -> Iterator[Step]:
        """The epoch's steps from ``position``: this rank's loader batches up to each step's end, then (with a
        global batch whose last step not every rank has a batch in) a final step averaged explicitly."""
        loop, epochs = self.run.loop, self.run.epochs
        plan = epochs.begin(position, self.accumulation, loop.seed, loop.state.epoch)
        done = position // epochs.entries_per_round  # this rank's batches before the position
        self._busy, self._batches = 0.0, 0
        batches = enumerate(epochs.source.training_batches())
        together = loop.plugin.forwards_together and is_distributed()  # a sharded model's forwards
        step: Step = Step()
        while (first := next(batches, None)) is not None:
            if together and plan.in_final_step(first[0]):
                break
            step = _ShardStep(self.run, plan, first, batches, done)
            yield step
            self._busy, self._batches = self._busy + step.busy, self._batches + step.trained
        if plan.final_step and together:  # every rank as many batches, the last one reduces
            step = _FinalStepTogether(self.run, plan, first, batches, done)
            yield step
            self._busy, self._batches = self._busy + step.busy, self._batches + step.trained
        elif plan.final_step:  # a last, smaller step of a global batch: not every rank had a batch in it
            unfinished = step if isinstance(step, _ShardStep) and not step.position else Step()
            yield _FinalStep(self.run, plan, unfinished)

    def epoch_totals(self) -> EpochTotals:
        """The epoch's train loss and items over every rank, each rank's time per batch and peak memory: one
        gather (the epoch's one read of its loss sums)."""
        loop, state = self.run.loop, self.run.loop.state
        own = [self._busy / max(1, self._batches), float(peak_memory(loop.device))]
        tokens = torch.as_tensor(state.epoch_tokens, dtype=torch.float64).reshape(1).cpu()
        mine = torch.cat([state.epoch_sums.cpu(), torch.tensor(own, dtype=torch.float64), tokens])
        per_rank = mp_sync(mine).view(-1, 5)
        loop.step_times = (1000 * per_rank[:, 2]).tolist() if per_rank.shape[0] > 1 else []
        sums = per_rank[:, :2].sum(0)
        total_tokens = float(per_rank[:, 4].sum()) if loop.tokens_fn is not None else None
        return EpochTotals(state.epoch_loss(sums), float(sums[1]), [int(b) for b in per_rank[:, 3].tolist()],
                           total_tokens)  # fmt: skip

    def gathered(self, position: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """Every rank's random state and the ranks' summed loss sums (two small collectives; every rank)."""
        sums = self.run.loop.state.epoch_sums
        return all_gather_object(rng_state()), sync_ddp(sums.clone()) if position else torch.zeros_like(sums)


class _ShardStep(Step):
    """One DDP step: this rank's batches from ``first`` until the plan ends the step (DDP's all-reduce runs in
    the backward of its last)."""

    def __init__(self, run: TrainingRun, plan: StepPlan, first: _Numbered, rest: Iterator[_Numbered], done: int
                 ) -> None:  # fmt: skip
        super().__init__()
        self.run, self.plan, self.first, self.rest, self.done = run, plan, first, rest, done
        #: Entries of the epoch done once this step is; 0 while (or when) it has not ended.
        self.position = 0

    def batches(self) -> Iterator[Batch]:
        plan, numbered = self.plan, self.first
        while True:
            index, (data, weight, last) = numbered
            ends = plan.ends_step(index) or last
            yield Batch(data, weight / plan.divisor(index), weight, plan.batch_seed(index), ends, self.done + index)
            if ends:
                self.position = plan.position_after(index)
                return
            following = next(self.rest, None)
            if following is None:  # the rank's last batch, in a global batch's final step
                return
            numbered = following

    def commit(self) -> CommittedStep | NotCommitted:
        """DDP averaged the gradients in the last batch's backward; the ranks agree on SLURM's signals. Deferred
        for the rank's last batches when a final step finishes them (:class:`_FinalStep`)."""
        if not self.position:
            return NotCommitted.DEFERRED
        return CommittedStep(self.position, self.counted, self.run.loop.preemption.agreed_signal())


class _FinalStep(Step):
    """A global batch's last, smaller step: the rank's batches in it (if any) were trained without DDP's
    all-reduce; its gradients are averaged here."""

    def __init__(self, run: TrainingRun, plan: StepPlan, unfinished: Step) -> None:
        super().__init__()
        self.run, self.plan = run, plan
        self.take_counts(unfinished)  # its batches, trained in the step before

    def batches(self) -> Iterator[Batch]:
        return iter(())

    def commit(self) -> CommittedStep:
        average_gradients(self.run.loop.model.parameters())
        return CommittedStep(self.plan.end_position(), self.counted, self.run.loop.preemption.agreed_signal())


class _FinalStepTogether(Step):
    """A global batch's last, smaller step when every forward is a collective (a sharded model): each rank
    runs as many batches as the rank with the most in it, its own and then ones that count nothing (the
    split's first item, loss scaled by 0), and the last one's backward reduces the gradients."""

    def __init__(self, run: TrainingRun, plan: StepPlan, first: _Numbered | None, rest: Iterator[_Numbered],
                 done: int) -> None:  # fmt: skip
        super().__init__()
        self.run, self.plan, self.first, self.rest, self.done = run, plan, first, rest, done

    def batches(self) -> Iterator[Batch]:
        plan, count = self.plan, self.plan.final_batches()
        own = itertools.chain([self.first] if self.first is not None else [], self.rest)
        for number in range(count):
            numbered = next(own, None)
            if numbered is None:  # this rank's batches ran out: one that counts nothing
                data = self.run.epochs.source.first_batch()
                yield Batch(data, 0.0, 0.0, None, number == count - 1, self.done)
                continue
            index, (data, weight, _) = numbered
            yield Batch(data, weight / plan.divisor(index), weight, plan.batch_seed(index), number == count - 1,
                        self.done + index)  # fmt: skip

    def commit(self) -> CommittedStep:
        """The last batch's backward reduced the gradients; the ranks agree on SLURM's signals."""
        return CommittedStep(self.plan.end_position(), self.counted, self.run.loop.preemption.agreed_signal())
