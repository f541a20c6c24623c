"""Checkpoints written while training goes on (``TrainLoop(checkpoint_async=True)``, Lightning's
``AsyncCheckpointIO``): the state is copied off the live tensors (into pinned memory from a GPU), then rank 0 writes
that copy in a thread of its own at the lowest CPU priority (training's threads first), atomically as ever; one
write at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import DDPKitError
from ddpkit.process_group import collective_device, get_rank, is_distributed
from ddpkit.training._state import TrainState

__all__ = ["AsyncWrites"]


class _Staging:
    """Copies of a state's tensors on the CPU (pinned when they come from a GPU), made into the buffers of the last
    copy where the shapes agree: after the first checkpoint, staging allocates nothing (and touches no new page)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._used = 0

    def copy(self, value: Any) -> Any:
        """``value`` with every tensor copied (sharing nothing with the live state)."""
        self._used = 0
        return self._copy(value)

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach())
        if isinstance(value, dict):
            return {key: self._copy(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item) for item in value)
        return value

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self._used = self._used, self._used + 1
        pinned = tensor.device.type != "cpu"
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.is_pinned() != pinned:
                buffer = self._buffers[index] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers.append(buffer)
        return buffer.copy_(tensor, non_blocking=pinned)


class AsyncWrites:
    """Rank 0's checkpoint writes in a thread, one at a time; every rank learns whether the last one failed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._staging = _Staging()

    def start(self, state: TrainState, path: Path, before: Callable[[], object] | None = None) -> None:
        """Write ``state`` to ``path`` in the background (rank 0), after ``before`` (every rank: a sharded model's
        write under way, which puts its directory in place), once the last write ended (:meth:`finish` first, on
        every rank: it agrees on whether that one failed)."""
        self._path = path
        if get_rank() != 0:
            if before is not None:
                self._thread = threading.Thread(target=self._write, args=(None, path, before),
                                                name="ddpkit-checkpoint-writer", daemon=True)  # fmt: skip
                self._thread.start()
            return
        self.wait()  # its copies are the buffers this one is copied into
        staged = TrainState(**self._staging.copy({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}))
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()  # the pinned copies are complete before the thread reads them
        self._thread = threading.Thread(target=self._write, args=(staged, path, before),
                                        name="ddpkit-checkpoint-writer", daemon=True)  # fmt: skip
        self._thread.start()

    def _write(self, state: TrainState | None, path: Path, before: Callable[[], object] | None) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's own niceness; elsewhere as it is
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # training's threads come first
        try:
            if before is not None:
                before()
            if state is not None:
                state.save(path)
        except BaseException as exc:  # said on every rank at the next finish()
            self._error = exc

    def wait(self) -> None:
        """Wait for this process's write, if one is under way (no collective)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def finish(self) -> None:
        """Wait for the write under way, then agree on every rank whether it failed (every rank calls it).

        Raises:
            OSError (rank 0: its own error) or :class:`~ddpkit.DDPKitError` (the other ranks, naming it): the last
                write failed; the checkpoint before it is the one in place.
        """
        self.wait()
        error, self._error = self._error, None
        failed = torch.tensor([0.0 if error is None else 1.0], device=collective_device())
        if is_distributed():
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is not None:
            raise error
        if float(failed[0]):
            raise DDPKitError(
                f"rank 0 could not write the checkpoint {self._path} in the background, so rank {get_rank()} stops "
                "too; the checkpoint before it is the one in place"
            )
