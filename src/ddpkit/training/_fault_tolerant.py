"""The step driver of a ``TrainLoop`` run as one replica group of a fault-tolerant job
(``TrainLoop(fault_tolerance=...)``); the epoch runner (``_run.py``) does the rest, as for DDP.

Every optimizer step is one torchft quorum (:class:`~ddpkit.fault_tolerance.ReplicaGroup`). The step
holds entries ``[position, position + G)`` of the epoch's global order (``G``: the global batch; the
epoch's last step what is left), whatever the quorum. With ``P`` participants of ``k`` ranks each, rank ``r``
of participant ``i`` is worker ``w = i * k + r`` of ``W = P * k``: it takes positions ``position + w``,
``position + w + W``, ... (as the distributed sampler deals positions over ranks) in micro-batches of the
training loader's batch size, each batch's loss (a mean over its items) weighted by ``items * W / step items``.
The gradients averaged over the group's ranks and then over the participants are the mean over the step's
items, as one process with a batch of ``G`` items computes them, on any number of replica groups of any size.

A step that is not committed (a group was lost during it) changes nothing and is done again, with the same
items, by the next quorum: every item is used once per epoch in the committed steps. A recovering group
takes a healthy peer's checkpoint (``TrainState``, versioned: weights, optimizer, scheduler, scaler,
callbacks, epoch, position, loss sums, history, random state), captured and restored by the code that
writes and resumes checkpoints, and the runner goes on from there.

The driver has no loop over epochs or batches of its own: the runner asks it for the epoch's steps
(:class:`_QuorumStep`), trains the batches each yields, and takes the steps it commits.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ddpkit._failures import StopWithoutRestart
from ddpkit.checkpoint import rng_state
from ddpkit.fault_tolerance import ReplicaGroup, TorchFT
from ddpkit.fault_tolerance._quorums import JobEnded, group_name
from ddpkit.process_group import get_rank, get_world_size
from ddpkit.samplers import DistributedSamplerWrapper
from ddpkit.training._ahead import ShareLoader
from ddpkit.training._deal import batch_seed, first_position, share_sizes, step_divisor
from ddpkit.training._driver import (
    Batch,
    Budget,
    CommittedStep,
    EpochTotals,
    LossSums,
    NotCommitted,
    Step,
    peak_memory,
)
from ddpkit.training._replica_checks import check_same_weights, numeric_buffers, weight_norms
from ddpkit.training._run import TrainingRun
from ddpkit.training._state import TrainState

__all__ = ["FaultTolerantSteps"]

log = logging.getLogger(__name__)


class _CannotGoOn(StopWithoutRestart):
    """The job cannot go on (its record says why): this group's process ends, and its agent does not start it
    again."""


class FaultTolerantSteps:
    """The steps of ``run`` (a set-up ``TrainLoop``) as one replica group, or one rank of it when the default
    process group has several ranks (a step driver of the epoch runner: in its ``with`` block this process is a
    member of the job's quorums). The DDP model's own all-reduce is off (every batch is unsynced): the group's
    ranks average their gradients with the quorum's (:meth:`ReplicaGroup.average_gradients`), once per step.

    Each step's share comes through the training loader (:class:`~ddpkit.training._ahead.ShareLoader`), whose
    workers load the next steps' shares ahead.

    Raises:
        ValueError: the training loader has no fixed batch size (a batch sampler), or no global order (a stream).
        TypeError: the optimizer is a ``ZeroRedundancyOptimizer`` (its state is sharded over the group's ranks:
            a peer's state could not be captured without a collective).
    """

    def __init__(self, run: TrainingRun, settings: TorchFT, global_batch_size: int, dealer: DistributedSamplerWrapper
                 ) -> None:  # fmt: skip
        self.run, self.settings, self.size, self.dealer = run, settings, global_batch_size, dealer
        #: This rank in its replica group, and the group's ranks.
        self.rank, self.ranks = get_rank(), get_world_size()
        self.loop = loop = run.loop
        loader = loop.train_loader
        if loader.batch_size is None:
            raise ValueError(
                "fault_tolerance deals each step's items over the replica groups in batches of the training "
                "loader's batch_size; this loader has a batch sampler: build it with batch_size=..."
            )
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: none made
        if zero is not None and isinstance(loop.optimizer, zero.ZeroRedundancyOptimizer):
            raise TypeError(
                "fault_tolerance with a ZeroRedundancyOptimizer: its state is sharded over the group's ranks, and a "
                "recovering group takes a peer's state while that peer trains, without a collective. Use the "
                "optimizer it wraps (each group holds the whole state)"
            )
        self.batch_size = int(loader.batch_size)
        self.data = ShareLoader(loader, self.batch_size, global_batch_size, self._order,
                                lambda epoch, low: batch_seed(loop.seed, epoch, low))  # fmt: skip
        #: Entries of the current epoch's global order done in committed steps.
        self.position = 0
        self.prefix = ""
        #: SLURM's signals reach a group's ranks through its node's ``ddpkit run --fault-tolerance`` and agent.
        self.forwarded = True
        self._group: ReplicaGroup | None = None
        self._budget: Budget | None = None  # the fit's, once its epochs began
        self._orders: dict[int, torch.Tensor] = {}
        # The model's parameters and numeric buffers, taken as each epoch begins (as DDP takes them once).
        self._parameters: list[torch.nn.Parameter] = []
        self._buffers: list[torch.Tensor] = []
        self._members: tuple[str, ...] = ()
        self._processes: tuple[str, ...] = ()
        self._writer = False  # whether this is rank 0 of participant 0 of the last committed step
        self._writing_group = False  # whether this is a rank of participant 0 of the last committed step
        self.last_deal: tuple[int, int | None] | None = None  # (participants, index) of the last step's quorum
        self._times: dict[str, tuple[float, int]] = {}  # this epoch: each group's (seconds per batch, steps)
        #: The replica groups whose times ``loop.step_times`` holds, in that order (after an epoch).
        self.timed: list[str] = []

    @classmethod
    def of(cls, run: TrainingRun, settings: TorchFT) -> FaultTolerantSteps:
        """The steps of ``run`` (a ``TrainLoop`` with ``global_batch_size``) as one replica group, once set up
        (every rank of the group calls it).

        Raises:
            ValueError: the loader cannot be dealt.
        """
        run.setup(None)  # the sampler gives each epoch's order; the steps deal it
        assert run.loop.global_batch is not None
        dealer = run.epochs.source.whole_order("fault_tolerance")  # every rank of a group draws it: steps deal it
        return cls(run, settings, run.loop.global_batch.size, dealer)

    # --- the state a recovering group takes --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What a recovering peer takes from this group: the run's checkpoint (``TrainState.to_dict``) at this
        group's position (read by torchft while this group waits for the quorum; no collective)."""
        return self.run.capture(self.position, self).to_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Take a healthy peer's :meth:`state_dict` (torchft calls it at the commit of this group's first step),
        as a checkpoint is resumed; this group's own counts of failed and re-dealt steps stay its own."""
        self.position = self.run.take_over(
            TrainState.from_dict(saved, f"the state replica group {self.settings.replica_id} took")
        )

    def gathered(self, position: int) -> tuple[list[dict[str, Any]], torch.Tensor]:
        """This rank's random state (each batch is reseeded) and the job's loss sums of the epoch's committed
        steps, which rode with their gradients (the run's epoch sums count them): no collective."""
        return [rng_state()], self.loop.state.epoch_sums.cpu()

    # --- the run ----------------------------------------------------------------------------------

    def __enter__(self) -> FaultTolerantSteps:
        self.settings = self.settings.resolved()  # the logs name this group (its id may come from the environment)
        self.prefix = f"[{self.settings.replica_id}] "
        done = self.loop.state.global_step  # a checkpoint's steps (torchft counts the job's first quorum too)
        with self.ending():  # the job finished, or cannot go on: its record says so
            self._group = self.settings.join(self.state_dict, self.load_state_dict, done + 1 if done else 0)
        self.data.start_workers()
        return self

    def __exit__(self, *exc: object) -> None:
        state = self.loop.state
        trained = self._budget is not None and self._budget.done(state)
        if exc[0] is None and trained and self._group is not None:
            self._group.finish()  # a group that starts or comes back after this trains nothing
        self.data.close()
        if self._group is not None:
            self._group.close()
            self._group = None

    @contextlib.contextmanager
    def ending(self) -> Iterator[None]:
        """End this group's process (every rank of the group, rank 0 saying why) when the job has nothing left for
        it (:class:`~ddpkit.fault_tolerance._quorums.JobEnded`): status 0 when the job finished, else status 1
        without a restart by its agent (every group that held the job's state is gone, and no checkpoint holds
        it). Either way it writes no checkpoint."""
        try:
            yield
        except JobEnded as ended:
            if self.rank == 0:
                also = ": it trains nothing and ends" if ended.status == 0 else ""
                sys.stderr.write(f"ddpkit: replica group {self.settings.replica_id}: {ended.why}{also}\n")
                sys.stderr.flush()
            raise (SystemExit(0) if ended.status == 0 else _CannotGoOn(ended.status)) from None

    @property
    def leader(self) -> bool:
        """Whether this is rank 0 of the group that was participant 0 of the last committed step: it prints and
        writes checkpoints."""
        return self._writer

    @property
    def saves(self) -> bool:
        """Whether this is a rank of the group that was participant 0 of the last committed step (every rank of
        it writes the checkpoint together: rank 0 writes, the others wait)."""
        return self._writing_group

    def epoch(self, position: int, budget: Budget) -> Iterator[Step]:
        """The steps of the run's current epoch from ``position``, one quorum each, until its order is done. A
        recovering group takes its peer's epoch and position in a commit and goes on from there."""
        assert self._group is not None, "FaultTolerantSteps.epoch outside its with block"
        self.position, self._budget = position, budget
        self._times = {}
        self.loop.optimizer.zero_grad(set_to_none=True)  # then each step leaves none (taken, or not committed)
        self._parameters, self._buffers = list(self.loop.model.parameters()), numeric_buffers(self.loop.model)
        while self.position < self._items(self.loop.state.epoch):
            yield _QuorumStep(self, self._group)

    def epoch_totals(self) -> EpochTotals:
        """The epoch's train loss and items over every group (its sums came with each step's gradients), each
        group's time per batch; the peak memory of this process only (no collective)."""
        self.timed = sorted(self._times)
        self.loop.step_times = [1000 * self._times[name][0] / self._times[name][1] for name in self.timed]
        state = self.loop.state
        sums = state.epoch_sums.cpu()  # every group's: the steps' job_sums
        tokens = float(state.epoch_tokens) if self.loop.tokens_fn is not None else None
        return EpochTotals(state.epoch_loss(sums), float(sums[1]), [peak_memory(self.loop.device)], tokens)

    def _items(self, epoch: int) -> int:
        """Entries in epoch ``epoch``'s global order."""
        return int(self._order(epoch).shape[0])

    def _order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s global order (dataset indices), the same in every group."""
        if epoch not in self._orders:
            self._orders = {}  # one epoch at a time
            self.dealer.set_epoch(epoch)
            self._orders[epoch] = torch.as_tensor(list(self.dealer), dtype=torch.int64)
        return self._orders[epoch]

    def share(self, step_items: int, epoch: int, low: int, participants: int, index: int | None) -> Iterator[Batch]:
        """The batches of this rank's share of participant ``index``'s share of the step of ``step_items`` items
        from position ``low`` of ``epoch`` among ``participants``; none for ``None``. Each batch's loss (a mean
        over its items) is scaled by ``items * W / step items`` (``W``: every rank of every participant).

        A sharded model (every forward a collective of the group's ranks) runs as many batches on each rank of
        the group as its rank 0 (which has the most), the missing ones counting nothing, and the last one's
        backward reduce-scatters the gradients over the group's ranks."""
        if index is None:
            return
        workers, worker = participants * self.ranks, index * self.ranks + self.rank  # this rank as a worker
        sizes = share_sizes(step_items, workers, worker, self.batch_size)
        loaded = self.data.share(epoch, low, workers, worker)
        together = self.loop.plugin.forwards_together
        count = len(share_sizes(step_items, workers, index * self.ranks, self.batch_size)) if together else len(sizes)
        for number, (size, data) in enumerate(zip(sizes, loaded, strict=True)):
            seed = batch_seed(self.loop.seed, epoch, first_position(low, workers, worker, number, self.batch_size))
            yield Batch(data, 1.0 / step_divisor(step_items, size, workers), seed=seed,
                        synced=together and number == count - 1, index=low // self.size)  # fmt: skip
        for number in range(len(sizes), count):  # a sharded model's: batches that count nothing
            yield Batch(self.run.epochs.source.first_batch(), 0.0, 0.0, synced=number == count - 1,
                        index=low // self.size)  # fmt: skip

    def commit(self, group: ReplicaGroup, step: _QuorumStep) -> CommittedStep | NotCommitted:
        """Average ``step``'s gradients over the quorum's participants with what rides with them, and commit;
        ``NotCommitted.AGAIN`` when it was not (the next quorum does it again)."""
        loop, state = self.loop, self.loop.state
        participants, index = step.deal
        own = weight_norms(self._parameters) if index is not None else [0.0, 0.0]
        buffers = self._buffers
        members = self._members  # the quorum's names, sorted (noted when its batches were dealt)
        riding, head = self._riding(step, own, buffers)
        # A sharded model's norms are this rank's shards': compared with the same rank of the other groups only.
        sharded = loop.plugin.forwards_together
        averaged = group.average_gradients(self._parameters, also=riding, sharded=sharded, own=2 if sharded else 0)
        # The numbers that rode, now their means over the participants, read at once: the weights' norms (2), the
        # loss sums (2), the tokens (1), SLURM's flags (2), each group's time per batch; then the buffers.
        means = riding[:head].tolist()
        mean_norms, mean_sums, mean_tokens, mean_flags, mean_times = (
            means[0:2], means[2:4], means[4], means[5:7], means[7:head]
        )  # fmt: skip
        if not averaged:  # the step fails (commit says so): no sums of the job's come from it
            mean_sums, mean_tokens = [0.0, 0.0], 0.0
        elif index is not None:
            check_same_weights(str(self.settings.replica_id), own, mean_norms, state.global_step + 1)
        if not group.commit():  # a recovering group takes its peer's state in it (load_state_dict)
            loop.optimizer.zero_grad(set_to_none=True)
            state.failed_steps += 1
            log.warning(
                "replica group %s: step %d was not committed (replica groups %s)%s; the next quorum does it again",
                self.settings.replica_id, state.global_step + 1, ", ".join(self._members),
                f": {group.failure}" if group.failure else "",
            )  # fmt: skip
            return NotCommitted.AGAIN
        # Every group takes the participants' mean of the buffers, as DDP makes every rank's the same.
        if buffers:
            with torch.no_grad():
                for buffer, mean in zip(buffers, torch.split(riding[head:], [b.numel() for b in buffers]), strict=True):
                    buffer.copy_((mean if buffer.is_floating_point() else mean.round()).view_as(buffer))
        for name, seconds in zip(members, (mean * participants for mean in mean_times), strict=True):
            if seconds > 0:  # a group that trained a share in this step
                total, steps = self._times.get(name, (0.0, 0))
                self._times[name] = (total + seconds, steps + 1)
        # A recovering group took its peer's state in commit(): the step's size is that of the peer's position.
        self.position += min(self.size, self._items(state.epoch) - self.position)
        self._writing_group = index == 0
        self._writer = self._writing_group and self.rank == 0
        signal = loop.preemption.signal_of(mean_flags)
        workers = participants * self.ranks  # the sums' mean over every rank of the participants -> their sum
        loss_sum, items = mean_sums[0] * workers, mean_sums[1] * workers
        job = LossSums.summed(loss_sum, items, mean_tokens * workers)  # the epoch's totals count these
        return CommittedStep(self.position, step.counted, signal, {"replica_groups": float(participants)}, job)

    def _riding(self, step: _QuorumStep, own: list[float], buffers: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        """What rides with ``step``'s gradients, one float64 tensor, and the length of its head: the weights' norms
        ``own``, the loss sums, the tokens, SLURM's signals, each group's time per batch of loading and forward (in
        its slot: the quorum's names, sorted); then the ``buffers`` (BatchNorm's statistics; zeros from a
        recovering group). Made from numbers on the host, and the buffers."""
        loop, index, members = self.loop, step.deal[1], self._members
        times = [0.0] * len(members)
        if index is not None and self.settings.replica_id in members:
            times[members.index(self.settings.replica_id)] = step.busy / max(1, step.trained)
        flags = loop.preemption.received_flags()
        head = torch.tensor([*own, *step.counted.host_sums(), *flags, *times], dtype=torch.float64)
        mine = [b.detach().reshape(-1).double().cpu() for b in buffers] if index is not None else []
        if index is None and buffers:  # a recovering group adds zeros
            mine = [torch.zeros(sum(b.numel() for b in buffers), dtype=torch.float64)]
        return (torch.cat([head, *mine]) if mine else head), head.numel()

    def _note_members(self, processes: tuple[str, ...], step: int) -> None:
        """Log who left, joined or was started again since the last step's quorum, in one line from the group's
        rank 0 (``processes``: the quorum's ``NAME:uuid`` ids, a new uuid for each process of a group)."""
        if processes == self._processes:  # the last step's quorum
            return
        now = {group_name(process): process for process in processes}
        before = {group_name(process): process for process in self._processes}
        if before and now != before and self.rank == 0:
            left, joined = sorted(set(before) - set(now)), sorted(set(now) - set(before))
            again = sorted(name for name in set(now) & set(before) if now[name] != before[name])
            events = [
                *([f"{', '.join(left)} left the quorum (lost, hung, or late for the step's quorum)"] if left else []),
                *([f"{', '.join(again)} came back as a new process (it had died)"] if again else []),
                *([f"{', '.join(joined)} joined"] if joined else []),
            ]
            log.warning(
                "replica group %s at step %d: %s; the quorum is now %s",
                self.settings.replica_id, step + 1, "; ".join(events), ", ".join(sorted(now)),
            )  # fmt: skip
        self._processes, self._members = processes, tuple(sorted(now))


class _QuorumStep(Step):
    """One optimizer step of a replica group: one torchft quorum. Its batches are this rank's share as the last
    step's quorum dealt (computed while this one forms), then, when the quorum deals otherwise, the share it
    deals; the job's first quorum trains nothing (every group but one takes that one's state)."""

    def __init__(self, driver: FaultTolerantSteps, group: ReplicaGroup) -> None:
        super().__init__()
        self.driver, self.group = driver, group
        #: ``(participants, index)`` of the step's quorum (``index``: this group's, ``None`` when it heals).
        self.deal: tuple[int, int | None] = (0, None)
        self.first = False

    def batches(self) -> Iterator[Batch]:
        driver, group = self.driver, self.group
        loop, state = driver.loop, driver.loop.state
        group.start_step()  # the quorum forms while this group computes the share it had in the last step
        epoch, low = state.epoch, driver.position
        items = min(driver.size, driver._items(epoch) - low)  # the step's
        # No zero_grad: the epoch began with none, and every step leaves none (taken, not committed, the first).
        guess = driver.last_deal
        if guess is not None:
            yield from driver.share(items, epoch, low, *guess)
        with driver.ending():  # the quorum's verdict: the job may have finished, or be unable to go on
            self.deal = (group.participants, group.participant_index)
        driver._note_members(group.member_processes, state.global_step)
        self.first = group.step == 0
        if self.first:  # the job's first quorum: every group but one takes that one's state (torchft's init_sync)
            return
        if self.deal != guess:  # another quorum than the last step's: deal the step again
            if guess is not None and guess[1] is not None:
                state.dealt_again += 1
            loop.optimizer.zero_grad(set_to_none=True)
            self.restart()
            yield from driver.share(items, epoch, low, *self.deal)
        driver.last_deal = self.deal

    def commit(self) -> CommittedStep | NotCommitted:
        if self.first:
            self._synchronise()
            return NotCommitted.AGAIN
        return self.driver.commit(self.group, self)

    def _synchronise(self) -> None:
        """The job's first quorum: no items and no optimizer step. torchft gives every group of it but one (the
        recovery source) that one's state, but still counts them in the step's average: a step trained then
        would lose their shares."""
        self.driver.loop.optimizer.zero_grad(set_to_none=True)
        self.driver.last_deal = None
        if not self.group.commit():
            self.driver.loop.state.failed_steps += 1
