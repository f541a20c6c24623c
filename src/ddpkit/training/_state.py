"""Where a ``TrainLoop`` run stands: :class:`RunState` (owned by the loop) and :class:`TrainState` (a checkpoint).

``TrainLoop`` keeps everything that changes while it trains in one :class:`RunState`; its public attributes
``epoch``, ``global_step``, ``history``, ``step_loss`` and ``should_stop`` are that state's fields
(:class:`RunField`). A checkpoint is a :class:`TrainState`: the run state, the weights, the optimizer, the
callbacks' states and every rank's random state. To add a field to ``TrainLoop``'s checkpoints, add it to
:class:`TrainState` (and bump its version if old checkpoints lack it).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar, overload

import torch

from ddpkit.checkpoint import load_checkpoint, remove_unnamed_sharded, save_checkpoint, set_rng_state
from ddpkit.errors import DDPKitError
from ddpkit.hangs._watchdog import paused
from ddpkit.process_group import get_rank, get_world_size, rank_zero_first
from ddpkit.training._driver import LossSums
from ddpkit.training._steps import TrainingEpochs

log = logging.getLogger(__name__)

__all__ = ["RunField", "RunState", "StepMetrics", "TrainState"]

T = TypeVar("T")


def _sums() -> torch.Tensor:
    return torch.zeros(2, dtype=torch.float64)


class StepMetrics(Mapping[str, float]):
    """What the last optimizer step measured besides its loss, as floats (``TrainLoop.step_metrics``). A value the
    step computed on the device (the gradients' norm) stays there until it is read: the step itself never waits
    for the device, and a callback or logger that reads a value reads it once (it is kept)."""

    def __init__(self, values: Mapping[str, float | torch.Tensor] | None = None) -> None:
        self._values: dict[str, float | torch.Tensor] = dict(values or {})

    def __getitem__(self, name: str) -> float:
        value = self._values[name]
        if isinstance(value, torch.Tensor):
            value = self._values[name] = float(value)  # the one read of it
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(dict(self))


_NO_METRICS = StepMetrics()  # a step that measured nothing else (it never changes: nothing to read)
#: Batch losses counted before they are added to the epoch's loss sum at once (a step's own cost stays a list append).
_PENDING = 256


@dataclass
class RunState:
    """What changes while a ``TrainLoop`` trains; the loop owns it, checkpoints capture and restore it.

    Attributes:
        epoch: the epoch in progress (0-based); at an epoch's end, the next one.
        global_step: optimizer steps taken in all.
        resume_position: entries of ``epoch``'s global order that a resumed run
            skips at the epoch's start (0 but right after a mid-epoch resume).
        resumed_sums: ``(2,)`` float64: the loss sum and sample count of every
            process in the epoch before the run resumed it (from a checkpoint, or
            with fault tolerance from another replica group's state); zeros
            when the epoch began here.
        history: per epoch, ``train_loss`` and ``validation_<metric>`` (and
            ``lr``, ``skipped_steps`` when a scheduler, fp16 are used).
        should_stop: set by a callback (on every rank) to end ``fit``: in ``on_batch_end``, after that optimizer
            step (its checkpoint written), in ``on_epoch_end`` after that epoch.
        step_metrics: what the last optimizer step measured besides its loss,
            the same on every rank: ``lr`` (the learning rate it used, with a
            scheduler) and ``grad_norm`` (the gradients' norm before clipping,
            with clipping).
        skipped_steps: optimizer steps that fp16's gradient scaler skipped (inf
            or nan gradients) in all.
        failed_steps: with fault tolerance, steps this replica group did that
            were not committed (a group was lost during them) and were done again.
        dealt_again: with fault tolerance, steps whose share this group computed
            while the quorum formed (its share in the last step's quorum) and
            computed again because the quorum had changed.
    """

    epoch: int = 0
    global_step: int = 0
    resume_position: int = 0
    resumed_sums: torch.Tensor = field(default_factory=_sums)
    history: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    should_stop: bool = False
    step_metrics: StepMetrics = field(default_factory=StepMetrics)
    skipped_steps: int = 0
    failed_steps: int = 0
    dealt_again: int = 0
    # The epoch's loss sum (0-d float64 on the losses' device, None before a loss) and item count, and the last
    # step's sums: epoch_sums and step_loss, made when asked for.
    _epoch_loss: torch.Tensor | None = field(default=None, init=False, repr=False)
    _pending: list[tuple[torch.Tensor, float]] = field(default_factory=list, init=False, repr=False)  # not added yet
    _epoch_items: float = field(default=0.0, init=False, repr=False)
    _host_loss: float = field(default=0.0, init=False, repr=False)  # of the epoch's loss sum: what came as a number
    _last_step: LossSums = field(default_factory=LossSums, init=False, repr=False)
    # The epoch's tokens (a float, or a float64 tensor on the device: the loop's tokens_fn), as _epoch_items.
    _epoch_tokens: float | torch.Tensor = field(default=0.0, init=False, repr=False)

    @property
    def epoch_tokens(self) -> float | torch.Tensor:
        """This rank's tokens in the steps it took in the epoch since it began or resumed (the loop's ``tokens_fn``;
        0 without one): a float, or a 0-d float64 tensor on the device of the counts, not read back."""
        return self._epoch_tokens

    @property
    def epoch_sums(self) -> torch.Tensor:
        """``(2,)`` float64: this rank's loss sum and sample count in the steps it took in the epoch since it
        began or resumed, on the device of its losses (CPU before one)."""
        self._add_pending()
        sums = torch.zeros(2, dtype=torch.float64, device=None if self._epoch_loss is None else self._epoch_loss.device)
        if self._epoch_loss is not None:
            sums[0].copy_(self._epoch_loss)
        sums[0].add_(self._host_loss)
        sums[1].fill_(self._epoch_items)
        return sums

    @property
    def step_loss(self) -> torch.Tensor:
        """``(2,)`` float64: this rank's loss sum and sample count in the last optimizer step (zeros before one), on
        the device of its losses: made when first asked for, nothing read back to the host."""
        return self._last_step.tensor()

    def begin_epoch(self) -> int:
        """Start the epoch: the position it starts at (taken from :attr:`resume_position`, which becomes 0)."""
        position, self.resume_position = self.resume_position, 0
        self.reset_epoch_sums()
        if not position:
            self.resumed_sums = _sums()
        return position

    def reset_epoch_sums(self) -> None:
        """Forget the epoch's loss sums (:attr:`epoch_sums` becomes zeros)."""
        self._epoch_loss, self._epoch_items, self._epoch_tokens, self._host_loss = None, 0.0, 0.0, 0.0
        self._pending = []

    def _add_pending(self) -> None:
        """Add the batch losses counted since the last call to the epoch's loss sum, each times its items: the losses
        of one item count (dtype, device) stacked and summed at once, three tensor operations for up to :data:`_PENDING`
        batches (a step adds none of its own; nothing is copied to or read from the device)."""
        if not self._pending:
            return
        alike: dict[tuple[float, torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
        for loss, items in self._pending:
            alike[items, loss.dtype, loss.device].append(loss)
        self._pending = []
        for (items, _, _), losses in alike.items():
            if self._epoch_loss is None:
                self._epoch_loss = torch.zeros((), dtype=torch.float64, device=losses[0].device)
            self._epoch_loss.add_(torch.stack(losses).sum(dtype=torch.float64), alpha=items)

    def count_step(
        self, sums: LossSums, taken: bool = True, job_sums: LossSums | None = None, **metrics: float | torch.Tensor
    ) -> None:
        """Count an optimizer step (``taken``: not skipped by fp16's scaler) whose loss sum and sample count on
        this rank were ``sums`` (nothing is read back to the host; its losses are added to the epoch's by the
        hundred):
        :attr:`step_loss` becomes them, :attr:`step_metrics` ``metrics`` (a tensor among them is read when a
        callback asks for it). The epoch's sums (:attr:`epoch_sums`, :attr:`epoch_tokens`) add ``job_sums``
        where the step has them (every replica group's, under fault tolerance), else ``sums``."""
        self.global_step += 1
        self.skipped_steps += not taken
        self.step_metrics = StepMetrics(metrics) if metrics else _NO_METRICS
        self._last_step = sums
        counted = sums if job_sums is None else job_sums
        self._pending.extend(counted.losses)
        self._host_loss += counted.host_loss
        if len(self._pending) >= _PENDING:
            self._add_pending()
        self._epoch_items += counted.items
        if not isinstance(counted.tokens, float) or counted.tokens:
            self._epoch_tokens = self._epoch_tokens + counted.tokens

    def epoch_loss(self, sums: torch.Tensor) -> float:
        """The epoch's train loss from ``sums``, every process's loss sum and sample count in the steps since
        the epoch began or resumed (with what came before, :attr:`resumed_sums`); nan without samples (one read
        of the device, at the epoch's end)."""
        total = (sums.double().cpu() + self.resumed_sums.cpu()).tolist()
        return total[0] / total[1] if total[1] else float("nan")


class HasRunState(Protocol):
    state: RunState


class RunField(Generic[T]):
    """A ``TrainLoop`` attribute that is the field of the same name of its :class:`RunState`."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loop: None, owner: type | None = None) -> RunField[T]: ...

    @overload
    def __get__(self, loop: HasRunState, owner: type | None = None) -> T: ...

    def __get__(self, loop: HasRunState | None, owner: type | None = None) -> RunField[T] | T:
        if loop is None:
            return self
        value: T = getattr(loop.state, self.name)
        return value

    def __set__(self, loop: HasRunState, value: T) -> None:
        setattr(loop.state, self.name, value)


@dataclass
class TrainState:
    """Where a ``TrainLoop`` run stands: everything it needs to go on at the exact batch (one checkpoint).

    Attributes:
        model: the model's ``state_dict()``.
        optimizer: the optimizer's ``state_dict()``.
        epoch: the epoch in progress (0-based); at an epoch's end, the next one.
        position: entries of ``epoch``'s global order done (0 at an epoch's
            start): items, or whole batches of a batch sampler, of all ranks
            together, so that any number of ranks can go on from it.
        epoch_sums: ``(2,)`` float64: the epoch's loss sum and sample count so far, over all ranks.
        global_step: optimizer steps taken in all.
        seed: the base seed of the data order.
        world_size: the number of ranks that wrote it.
        rng: every rank's random state (``rng_state``), by rank.
        history: the per-epoch numbers so far (``train_loss``, ``validation_*``).
        batch: in checkpoints of ddpkit 0.1 (version 1), the position as batches
            of ``epoch`` each rank had done; ``None`` since.
        callbacks: each callback's ``state_dict()``, by callback.
        stream: for a training stream part-way through ``epoch``, the items
            every rank has taken (plain data: the stream skips them on resume);
            ``None`` otherwise. ``position`` then counts the batches all ranks took.
        recipe: the learning-rate scheduler's and fp16 gradient scaler's
            states (``lr_scheduler``, ``grad_scaler``), when the run has them.
        skipped_steps: optimizer steps fp16's scaler skipped so far.
        sharded: for a sharded model (``FSDPPlugin``), the name of the directory
            beside the checkpoint file that holds the weights and the optimizer
            state (``torch.distributed.checkpoint``'s format; ``model`` and
            ``optimizer`` are then empty); ``None`` when they are in the file.
    """

    #: The layout of the fields; versions 1 (ddpkit 0.1), 2 (without ``stream``), 3 (without ``recipe``,
    #: ``skipped_steps``) and 4 (without ``sharded``) are read too, others refused.
    VERSION: ClassVar[int] = 5

    model: dict[str, Any]
    optimizer: dict[str, Any]
    epoch: int
    position: int
    epoch_sums: torch.Tensor
    global_step: int
    seed: int
    world_size: int
    rng: list[dict[str, Any]]
    history: dict[str, list[float]] = field(default_factory=dict)
    batch: int | None = None
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)
    stream: list[Any] | None = None
    recipe: dict[str, Any] = field(default_factory=dict)
    skipped_steps: int = 0
    sharded: str | None = None

    @classmethod
    def capture(
        cls, run: RunState, position: int, epochs: TrainingEpochs, *, model: dict[str, Any],
        optimizer: dict[str, Any], callbacks: dict[str, dict[str, Any]], seed: int, recipe: dict[str, Any],
        rngs: list[dict[str, Any]], epoch_sums: torch.Tensor, sharded: str | None = None,
    ) -> TrainState:  # fmt: skip
        """The state of ``run`` after ``position`` entries of its current epoch's global order (``epochs``: the
        training loader's), with the given weights, optimizer, callback, scheduler and scaler states, random
        states (``rngs``, by rank) and every process's loss sums in the epoch's steps since it began or resumed
        (``epoch_sums``, ``(2,)`` float64) and, for a sharded model, the directory its weights and optimizer
        state were written to (``sharded``). No collective but a stream's (which items every rank has taken).
        """
        stream = epochs.source.taken() if position else None
        sums = epoch_sums.cpu() + run.resumed_sums if position else _sums()
        return cls(
            model=model, optimizer=optimizer, epoch=run.epoch, position=position, epoch_sums=sums,
            global_step=run.global_step, seed=seed, world_size=get_world_size(), rng=rngs,
            history={name: list(values) for name, values in run.history.items()}, callbacks=callbacks, stream=stream,
            recipe=recipe, skipped_steps=run.skipped_steps, sharded=sharded,
        )  # fmt: skip

    def restore(self, run: RunState, epochs: TrainingEpochs, *, keeps_steps: bool) -> None:
        """Put ``run`` where this state was, and this rank's random state (every rank calls it; ``epochs``: the
        training loader's, sharded). Weights, optimizer, callbacks, scheduler and
        scaler are the caller's to load; no collective.

        On another number of ranks than wrote it, the epoch goes on with exactly
        the entries not done yet. With a fixed global batch (``keeps_steps``) the
        steps are those of an uninterrupted run; without one, a step then holds
        another number of items, which a ``RuntimeWarning`` says.
        """
        position = self.position
        if self.batch is not None:  # ddpkit 0.1: batches per rank
            position = self.batch * self.world_size * epochs.entries_per_batch
        run.epoch, run.resume_position, run.global_step = self.epoch, position, self.global_step
        run.skipped_steps = self.skipped_steps
        if position:
            epochs.source.skip(self.stream)
        run.history = defaultdict(list, self.history)
        run.reset_epoch_sums()
        run.resumed_sums = self.epoch_sums.cpu().double() if position else _sums()
        if self.world_size != get_world_size() and not keeps_steps:
            warnings.warn(
                f"resuming a checkpoint of {self.world_size} ranks on {get_world_size()}: each optimizer step now "
                f"holds {get_world_size()}/{self.world_size} times the items it held, and random numbers differ "
                "from an uninterrupted run. Give TrainLoop a global_batch_size to keep the steps on any world size",
                RuntimeWarning,
                stacklevel=4,
            )
        set_rng_state(self.rng[get_rank() % len(self.rng)])

    def to_dict(self) -> dict[str, Any]:
        """Its fields and ``version``: tensors and plain values (what a checkpoint file holds, and what a
        fault-tolerant replica group sends a recovering peer)."""
        return {"version": self.VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str) -> TrainState:
        """The state :meth:`to_dict` gave (of this version or an older one), read from ``source``.

        Raises:
            ValueError: it is of another version, or not a ``TrainLoop`` state (the message names ``source``).
        """
        state = dict(data)
        version = state.pop("version", None)
        if version == 1:
            state["position"] = 0  # restore() takes it from "batch"
        elif not (isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= cls.VERSION):
            raise ValueError(
                f"{source} is a checkpoint of version {version!r}; this ddpkit reads TrainLoop checkpoints of versions "
                f"1 to {cls.VERSION}. Start from another checkpoint_dir, or resume with the ddpkit that wrote it"
            )
        try:
            return cls(**state)
        except TypeError as exc:
            raise ValueError(f"{source} is not a TrainLoop checkpoint: {exc}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write it atomically (:func:`~ddpkit.save_checkpoint`), then remove the sharded checkpoints beside it
        that it does not name; from one process. A checkpoint of a later step at ``path`` stays: a writer that was
        stopped (a fault-tolerant group's, in a stall) while the others went on never puts the run back."""

        def newer_there() -> bool:
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                return int(saved["global_step"]) > self.global_step
            except Exception:  # none there, or not one of ours: this one goes there
                return False

        if newer_there() or not save_checkpoint(self.to_dict(), path, keep_existing=newer_there):
            log.warning("the checkpoint of step %d was not written: %s holds a later step", self.global_step, path)
            return
        remove_unnamed_sharded(Path(path).parent, self.sharded)

    def write(self, path: str | os.PathLike[str]) -> None:
        """:meth:`save` on rank 0, with every rank told whether it could (every rank calls it).

        The other ranks' wait does not count as a hang. A failed write raises on
        every rank at once (rank 0: its own error, e.g. ``OSError``; the others:
        :class:`~ddpkit.DDPKitError` naming it) instead of leaving them waiting.
        """
        try:
            with paused(), rank_zero_first():  # rank 0 writes first; the others learn whether it could
                if get_rank() == 0:
                    self.save(path)
        except DDPKitError as exc:
            raise DDPKitError(
                f"rank 0 could not write the checkpoint {path}, so rank {get_rank()} stops too: {exc}"
            ) from exc

    @classmethod
    def load(cls, path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> TrainState:
        """Read what :meth:`save` wrote.

        Raises:
            FileNotFoundError: there is no checkpoint at ``path``.
            ValueError: it is of another version, or not a ``TrainLoop`` checkpoint.
        """
        return cls.from_dict(load_checkpoint(path, map_location), str(path))
