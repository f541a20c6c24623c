"""Atomic checkpoint files and every random generator's state.

A checkpoint is written to a temporary file in the same directory, flushed,
``fsync``-ed, then renamed over the previous one (``os.replace`` is atomic), and
the directory is ``fsync``-ed: a write interrupted at any point leaves the
previous checkpoint whole. Checkpoints load with ``torch.load(...,
weights_only=True)``: RNG states are stored as tensors, ints and strings, so
nothing needs unpickling. What a ``TrainLoop`` checkpoint holds is
``ddpkit.training.TrainState``.

A sharded model's weights and optimizer state (``FSDPPlugin``) go to a directory
beside the file, in torch's own format (``torch.distributed.checkpoint``, which
reshards them for any world size): every rank writes its shards into a
temporary directory, rank 0 renames it into place, and only then does the
file that names it replace the previous one. A directory no file names is a
write that did not finish (or an older checkpoint's), removed by the next write.

:func:`export` turns either kind into a plain ``state_dict`` file (or a
transformers model's ``save_pretrained`` directory).
"""

from __future__ import annotations

import contextlib
import glob
import os
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CHECKPOINT_FILE",
    "SHARDED_SUFFIX",
    "checkpoint_weights",
    "export",
    "load_checkpoint",
    "load_sharded",
    "remove_unnamed_sharded",
    "rng_state",
    "save_checkpoint",
    "save_sharded",
    "set_rng_state",
]

#: The file name of the latest checkpoint in a checkpoint directory.
CHECKPOINT_FILE = "last.pt"
_TEMPORARY_SUFFIX = ".tmp"
#: How a sharded checkpoint's directory name ends.
SHARDED_SUFFIX = ".dcp"
#: How the name of a sharded checkpoint that ``TrainLoop`` writes begins (:func:`sharded_name`).
_SHARDED_PREFIX = "last-"
#: Seconds after which a temporary file nobody changed counts as a killed writer's (removed by the next write).
STALE_AFTER_S = 600.0


def save_checkpoint(
    state: dict[str, Any], path: str | os.PathLike[str], keep_existing: Callable[[], bool] | None = None
) -> bool:
    """Write ``state`` to ``path`` atomically (temporary file, flush, fsync, rename, fsync of the directory);
    whether it was written: not when ``keep_existing()`` (asked once the file is written, just before the rename)
    says that the checkpoint already at ``path`` must stay (e.g. a newer one, written while this one was).

    Call it from one process per ``path`` (:class:`~ddpkit.TrainLoop` writes on
    rank 0 only); two that write at once each leave a whole file, the last one's.
    The temporary file is ``.<name>.<random>.tmp`` beside ``path``; ones left by
    a writer that was killed are removed by the next successful write once they
    have not changed for ``STALE_AFTER_S`` seconds (a newer one may be
    another writer's, still writing).

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
        if keep_existing is not None and keep_existing():
            os.unlink(temporary)
            return False
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    _fsync_directory(target.parent)
    old = time.time() - STALE_AFTER_S
    for stale in target.parent.glob(f"{glob.escape(prefix)}*{_TEMPORARY_SUFFIX}"):
        with contextlib.suppress(OSError):
            if stale.stat().st_mtime < old:
                stale.unlink()
    return True


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


def save_sharded(state: dict[str, Any], directory: str | os.PathLike[str], name: str) -> Path:
    """Write ``state`` (tensors and ``DTensor`` shards, e.g. ``get_state_dict``'s) as the sharded checkpoint
    ``directory / name`` with ``torch.distributed.checkpoint`` (every rank calls it, with the same ``name``).

    Every rank writes its shards into ``.<name>.tmp``; once all have (torch's
    save ends with a collective), rank 0 renames it to ``name``. Nothing names
    the new directory yet: the caller's checkpoint file does, written after.
    When ``name`` exists already (the same step written again, by a run
    restarted from an older checkpoint), it is first renamed to ``.<name>.old``
    and removed only once the new one is in place: at every moment one of the
    two is complete, and :func:`load_sharded` reads the old one when a crash
    came between the renames.

    Returns:
        The directory's path.

    Raises:
        OSError, or torch's ``CheckpointException`` naming each rank's error: the write failed on some rank
        (every rank raises).
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    target = Path(directory) / name
    temporary = target.with_name(f".{name}{_TEMPORARY_SUFFIX}")
    with _alone(dist.is_initialized()):
        dcp.save(state, checkpoint_id=temporary, no_dist=not dist.is_initialized())  # type: ignore[attr-defined]
    if not dist.is_initialized() or dist.get_rank() == 0:
        _place(temporary, target)
    return target


def start_saving_sharded(
    state: dict[str, Any], directory: str | os.PathLike[str], name: str, group: Any
) -> Callable[[], Path]:
    """:func:`save_sharded` with ``torch.distributed.checkpoint.async_save``: ``state`` is copied to the CPU before
    it returns, and the write goes on in a thread, its collectives on ``group`` (a gloo group of its own: not the
    one training uses at the same time). Returns ``finish``, which waits for this rank's write and, on rank 0,
    puts the directory in place (call it from a thread of your own; every rank calls both)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    target = Path(directory) / name
    temporary = target.with_name(f".{name}{_TEMPORARY_SUFFIX}")
    started: Any = dcp.async_save(state, checkpoint_id=temporary, process_group=group)  # type: ignore[attr-defined]
    if hasattr(started, "upload_completion"):  # torch's AsyncSaveResponse: a stager that copies in the background
        started.staging_completion.result()  # the copy is made before training changes the tensors
        started = started.upload_completion

    def finish() -> Path:
        started.result()  # rank 0's ends after every rank has written (its metadata gathers theirs)
        if dist.get_rank() == 0:
            _place(temporary, target)
        return target

    return finish


def _place(temporary: Path, target: Path) -> None:
    """Rename ``temporary`` to ``target``; one of the same name there already is renamed aside first and removed
    after (:func:`save_sharded`)."""
    old = _previous(target)
    if target.exists():  # the same step written again (a run restarted from an older checkpoint)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)  # complete, and found by load_sharded until the new one is in place
    os.replace(temporary, target)
    _fsync_directory(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _previous(target: Path) -> Path:
    """Where :func:`save_sharded` keeps ``target`` while it puts a new one of the same name in place."""
    return target.with_name(f".{target.name}.old")


def load_sharded(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Fill ``state`` in place from the sharded checkpoint at ``path`` (:func:`save_sharded`), resharded for
    this process's shards: ``state`` holds what to load, shaped as this run holds it (every rank calls it).

    Raises:
        FileNotFoundError: there is no sharded checkpoint at ``path``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    path = _complete_sharded(Path(path))
    with _alone(dist.is_initialized()):
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())  # type: ignore[attr-defined]


def _complete_sharded(path: Path) -> Path:
    """The complete sharded checkpoint of the name ``path``: itself, or the old one :func:`save_sharded` renamed
    aside when a crash came between its two renames.

    Raises:
        FileNotFoundError: neither is there.
    """
    if not (path / ".metadata").exists() and (_previous(path) / ".metadata").exists():
        return _previous(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"no sharded checkpoint at {path} (its .metadata is missing)")
    return path


@contextlib.contextmanager
def _alone(distributed: bool) -> Iterator[None]:
    """Without a process group: without torch's warning that it assumes one process (it is one, on purpose)."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def sharded_name(epoch: int, step: int, position: int) -> str:
    """The directory name of ``TrainLoop``'s sharded checkpoint after ``step`` optimizer steps, ``position``
    entries into epoch ``epoch`` (``last-e1-s30-p960.dcp``): one name per point of the run, so that a checkpoint
    file only ever names a complete one (:func:`remove_unnamed_sharded` removes the others)."""
    return f"{_SHARDED_PREFIX}e{epoch}-s{step}-p{position}{SHARDED_SUFFIX}"


def remove_unnamed_sharded(directory: str | os.PathLike[str], keep: str | None) -> None:
    """Remove the sharded checkpoints in ``directory`` other than ``keep`` (the one the checkpoint file names),
    and unfinished ones (from one process, after the file that names ``keep`` is in place). Only ``TrainLoop``'s
    (:func:`sharded_name`'s) are touched."""
    for path in Path(directory).iterdir():  # TrainLoop's names only (a user's own files stay)
        finished = path.name.startswith(_SHARDED_PREFIX) and path.name.endswith(SHARDED_SUFFIX) and path.name != keep
        unfinished = path.name.startswith(f".{_SHARDED_PREFIX}") and path.name.endswith(
            (SHARDED_SUFFIX + _TEMPORARY_SUFFIX, SHARDED_SUFFIX + ".old")
        )
        if (finished or unfinished) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


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


def export(
    checkpoint: str | os.PathLike[str], destination: str | os.PathLike[str], model: torch.nn.Module | None = None
) -> Path:
    """Turn a ``TrainLoop`` checkpoint, sharded or whole, into a plain ``state_dict``: the model's whole weights
    (on the CPU, float as trained), for ``model.load_state_dict``, other tools or a hub.

    It reads in this process alone, with no collective (call it on one rank,
    or with no process group): a sharded checkpoint is read whole, whatever
    the number of ranks that wrote it, through ``torch.distributed.checkpoint``,
    its weights only (not the optimizer state; torch's ``dcp_to_torch_save``
    converts the whole state).

    Args:
        checkpoint: a checkpoint directory (the one that holds ``last.pt``), a
            checkpoint file, or a sharded checkpoint's ``.dcp`` directory.
        destination: a file (``torch.save`` of the ``state_dict``), or, with a
            ``model`` that has ``save_pretrained`` (a transformers model), a
            directory for it: the weights are loaded into ``model``
            (``strict``) and ``model.save_pretrained(destination)`` writes them
            with its config (``from_pretrained(destination)`` loads them).
        model: optional; the weights are loaded into it (every key must match:
            its ``load_state_dict`` raises otherwise).

    Returns:
        What was written: the file, or the directory.

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint``.
        RuntimeError: ``model``'s ``load_state_dict`` refused the weights (names the missing and unexpected keys).

    Example:
        >>> ddpkit.checkpoint.export("runs/gpt2", "gpt2.pt")                      # a state_dict file
        >>> ddpkit.checkpoint.export("runs/gpt2", "gpt2-final", model=GPT2LMHeadModel(config))  # save_pretrained
    """
    weights = checkpoint_weights(checkpoint)
    target = Path(destination)
    if model is not None:
        model.load_state_dict(weights)
        save_pretrained = getattr(model, "save_pretrained", None)  # a transformers model's
        if callable(save_pretrained) and not target.suffix:
            save_pretrained(target)
            return target
    target.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(weights, target)
    return target


def checkpoint_weights(checkpoint: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The model's whole weights in a ``TrainLoop`` checkpoint (:func:`export`'s ``checkpoint``), on the CPU."""
    path = Path(checkpoint)
    if path.is_dir() and (path / CHECKPOINT_FILE).exists():
        path = path / CHECKPOINT_FILE
    if path.is_dir():
        return _sharded_weights(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}: give a checkpoint directory (with {CHECKPOINT_FILE}), a checkpoint file, or a "
            f"sharded checkpoint's {SHARDED_SUFFIX} directory"
        )
    state = load_checkpoint(path)
    if state.get("sharded"):
        return _sharded_weights(path.parent / state["sharded"])
    weights: dict[str, torch.Tensor] = state["model"]
    return weights


def _sharded_weights(path: Path) -> dict[str, torch.Tensor]:
    """The ``model`` part of a sharded checkpoint, whole: empty tensors of the shapes and dtypes its metadata
    gives, filled by ``torch.distributed.checkpoint.load`` (the optimizer state is not read)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    path = _complete_sharded(path)
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    weights = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    with _alone(False):
        load({"model": weights}, checkpoint_id=path, no_dist=True)
    return weights
