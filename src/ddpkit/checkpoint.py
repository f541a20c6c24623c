"""Atomic checkpoints, RNG state, and ``TrainState``: what a ``TrainLoop`` checkpoint holds.

A checkpoint is written to a temporary file in the same directory, flushed,
``fsync``-ed, then renamed over the previous one (``os.replace`` is atomic), and
the directory is ``fsync``-ed: a write interrupted at any point leaves the
previous checkpoint whole. Checkpoints load with ``torch.load(...,
weights_only=True)``: RNG states are stored as tensors, ints and strings, so
nothing needs unpickling. To add a field to ``TrainLoop``'s checkpoints, add it
to :class:`TrainState` (and bump its version if old checkpoints lack it).
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import tempfile
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from ddpkit._watchdog import paused
from ddpkit.collectives import all_gather_object, sync_ddp
from ddpkit.errors import DDPKitError
from ddpkit.process_group import get_rank, get_world_size, rank_zero_first

__all__ = ["CHECKPOINT_FILE", "TrainState", "load_checkpoint", "rng_state", "save_checkpoint", "set_rng_state"]

#: The file name of the latest checkpoint in a checkpoint directory.
CHECKPOINT_FILE = "last.pt"
_TEMPORARY_SUFFIX = ".tmp"


def save_checkpoint(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, flush, fsync, rename, fsync of the directory).

    Call it from one process per ``path`` (:class:`~ddpkit.TrainLoop` writes on
    rank 0 only). The temporary file is ``.<name>.<random>.tmp`` beside ``path``;
    ones left by a writer that was killed are removed after the next successful write.

    Raises:
        OSError: the directory cannot be created or written; ``path`` is untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}."
    descriptor, temporary = tempfile.mkstemp(prefix=prefix, suffix=_TEMPORARY_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(target.parent)
    for stale in target.parent.glob(f"{glob.escape(prefix)}*{_TEMPORARY_SUFFIX}"):
        with contextlib.suppress(OSError):
            stale.unlink()


def load_checkpoint(path: str | os.PathLike[str], map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (``weights_only=True``: no arbitrary unpickling).

    Args:
        path: the checkpoint file.
        map_location: where its tensors go (as ``torch.load``'s): a device, or
            ``"cpu"`` (default) whatever device they were saved from.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
    """
    state: dict[str, Any] = torch.load(path, map_location=map_location, weights_only=True)
    return state


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
        rng: every rank's random state (:func:`rng_state`), by rank.
        history: the per-epoch numbers so far (``train_loss``, ``validation_*``).
        batch: in checkpoints of ddpkit 0.1 (version 1), the position as batches
            of ``epoch`` each rank had done; ``None`` since.
        callbacks: each callback's ``state_dict()``, by callback.
        stream: for a training stream part-way through ``epoch``, the items
            every rank has taken (plain data: the stream skips them on resume);
            ``None`` otherwise. ``position`` then counts the batches all ranks took.
    """

    #: The layout of the fields; versions 1 (ddpkit 0.1) and 2 (without ``stream``) are read too, others refused.
    VERSION: ClassVar[int] = 3

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

    @classmethod
    def capture(cls, loop: Any, position: int) -> TrainState:
        """The state of ``loop`` (a ``TrainLoop``) after ``position`` entries of its current epoch's global order.

        Every rank must call it: it gathers every rank's RNG state and sums the
        epoch's partial loss (two small collectives).
        """
        rngs = all_gather_object(rng_state())
        stream = loop._epochs.stream_state() if position else None
        epoch_sums = sync_ddp(loop._epoch_sums.clone()) if position else torch.zeros(2, dtype=torch.float64)
        return cls(
            model=loop.model.state_dict(),
            optimizer=loop.plugin.optimizer_state(loop.optimizer),
            epoch=loop.epoch,
            position=position,
            epoch_sums=epoch_sums,
            global_step=loop.global_step,
            seed=loop.seed,
            world_size=get_world_size(),
            rng=rngs,
            history={name: list(values) for name, values in loop.history.items()},
            callbacks=loop.callbacks_handler.state_dicts(),
            stream=stream,
        )

    @classmethod
    def resume(cls, loop: Any) -> bool:
        """Restore ``loop`` (a ``TrainLoop``) from the checkpoint in its ``checkpoint_dir``, if there is one
        (every rank calls it); whether there was one."""
        if loop.checkpoint_dir is None or not (loop.checkpoint_dir / CHECKPOINT_FILE).exists():
            return False
        cls.load(loop.checkpoint_dir / CHECKPOINT_FILE, map_location=loop.device).restore(loop)
        return True

    def restore(self, loop: Any) -> None:
        """Put ``loop`` (a ``TrainLoop``) where this state was: weights, optimizer, position, history, and this
        rank's random state (every rank calls it; the loop is set up, its loaders sharded).

        On another number of ranks than wrote it, the epoch goes on with exactly
        the entries not done yet. With a ``global_batch_size`` the steps are
        those of an uninterrupted run; without one, a step then holds another
        number of items, which a ``RuntimeWarning`` says.
        """
        loop.model.load_state_dict(self.model)
        loop.optimizer.load_state_dict(self.optimizer)
        position = self.position
        if self.batch is not None:  # ddpkit 0.1: batches per rank
            position = self.batch * self.world_size * loop._epochs.entries_per_batch
        loop.epoch, loop._resume_position, loop.global_step = self.epoch, position, self.global_step
        if position:
            loop._epochs.resume_stream(self.stream)
        loop.history = defaultdict(list, self.history)
        loop.callbacks_handler.load_state_dicts(self.callbacks)
        first = get_rank() == 0 and position > 0  # rank 0 carries the partial sums of all ranks
        loop._epoch_sums = self.epoch_sums.cpu() if first else torch.zeros(2, dtype=torch.float64)
        if self.world_size != get_world_size() and loop.global_batch is None:
            warnings.warn(
                f"resuming a checkpoint of {self.world_size} ranks on {get_world_size()}: each optimizer step now "
                f"holds {get_world_size()}/{self.world_size} times the items it held, and random numbers differ "
                "from an uninterrupted run. Give TrainLoop a global_batch_size to keep the steps on any world size",
                RuntimeWarning,
                stacklevel=3,
            )
        set_rng_state(self.rng[get_rank() % len(self.rng)])

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write it atomically (:func:`save_checkpoint`); from one process."""
        save_checkpoint({"version": self.VERSION, **asdict(self)}, path)

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
        state = load_checkpoint(path, map_location)
        version = state.pop("version", None)
        if version == 1:
            state["position"] = 0  # restore() takes it from "batch"
        elif not (isinstance(version, int) and not isinstance(version, bool) and 1 <= version <= cls.VERSION):
            raise ValueError(
                f"{path} is a checkpoint of version {version!r}; this ddpkit reads TrainLoop checkpoints of versions "
                f"1 to {cls.VERSION}. Start from another checkpoint_dir, or resume with the ddpkit that wrote it"
            )
        try:
            return cls(**state)
        except TypeError as exc:
            raise ValueError(f"{path} is not a TrainLoop checkpoint: {exc}") from None


def rng_state() -> dict[str, Any]:
    """This process's random generator states: torch (CPU and each CUDA device), numpy, Python."""
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss = random.getstate()
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(i) for i in range(devices)],
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(position), int(has_gauss), cached],
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (CUDA states only for devices that exist)."""
    torch.set_rng_state(state["torch"].cpu())
    for index, cuda_state in enumerate(state.get("cuda", [])):
        if index < torch.cuda.device_count():
            torch.cuda.set_rng_state(cuda_state.cpu(), index)
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable (where the platform allows opening a directory)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
