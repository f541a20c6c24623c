"""Checkpoints written while training goes on (``TrainLoop(checkpoint_async=True)``, Lightning's
``AsyncCheckpointIO``): the state is copied off the live tensors (into pinned memory from a GPU), then rank 0 writes
that copy in a thread of its own at the lowest CPU priority (training's threads first), atomically as ever; one
write at a time.

What only an optimizer step changes (the parameters and the optimizer's state, on the CPU) is copied by that thread
while the next step's batches run forward and backward; the run waits for that copy (:meth:`AsyncWrites.staged`)
before anything can change them (the step's commit). Everything else (buffers, which a forward changes, random
states, counters) is copied at once; a GPU's tensors are copied at once too, without waiting for the device (the
thread waits for an event recorded after the copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Collection
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

    def copy(self, value: Any, later: Collection[int] = ()) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``value`` with every tensor copied (sharing nothing with the live state), but for the CPU tensors whose
        ``data_ptr`` is in ``later``: their buffers, and the ``(buffer, tensor)`` pairs to copy later."""
        self._used = 0
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        return self._copy(value, later, pending), pending

    def _copy(self, value: Any, later: Collection[int], pending: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value.detach(), later, pending)
        if isinstance(value, dict):
            return {key: self._copy(item, later, pending) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, later, pending) for item in value)
        return value

    def _tensor(self, tensor: torch.Tensor, later: Collection[int], pending: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> torch.Tensor:  # fmt: skip
        index, self._used = self._used, self._used + 1
        pinned = tensor.device.type != "cpu"
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.is_pinned() != pinned:
                buffer = self._buffers[index] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        else:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
            self._buffers.append(buffer)
        if not pinned and tensor.numel() and tensor.data_ptr() in later:
            pending.append((buffer, tensor))
            return buffer
        return buffer.copy_(tensor, non_blocking=pinned)


class AsyncWrites:
    """Rank 0's checkpoint writes in a thread, one at a time; every rank learns whether the last one failed."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._staging = _Staging()
        self._staged: threading.Event | None = None

    def start(self, state: TrainState, path: Path, before: Callable[[], object] | None = None,
              later: Collection[int] = ()) -> None:  # fmt: skip
        """Write ``state`` to ``path`` in the background (rank 0), after ``before`` (every rank: a sharded model's
        write under way, which puts its directory in place), once the last write ended (:meth:`finish` first, on
        every rank: it agrees on whether that one failed). The CPU tensors whose ``data_ptr`` is in ``later`` (the
        parameters' and the optimizer state's: only an optimizer step changes them) are copied in the background
        too: call :meth:`staged` before anything may change them."""
        self._path = path
        if get_rank() != 0:
            if before is not None:
                self._thread = threading.Thread(target=self._write, args=(None, path, before, [], None, None),
                                                name="ddpkit-checkpoint-writer", daemon=True)  # fmt: skip
                self._thread.start()
            return
        self.wait()  # its copies are the buffers this one is copied into
        fields, pending = self._staging.copy({f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, later)
        copied = None  # the pinned copies from a GPU, complete once the device passes this event
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record()
        self._staged = staged = threading.Event() if pending else None
        self._thread = threading.Thread(target=self._write, args=(TrainState(**fields), path, before, pending, staged,
                                        copied), name="ddpkit-checkpoint-writer", daemon=True)  # fmt: skip
        self._thread.start()

    def staged(self) -> None:
        """Wait until the background copy of the state being written is made (no collective): then the parameters
        and the optimizer's state may change."""
        if self._staged is not None:
            self._staged.wait()
            self._staged = None

    def _write(self, state: TrainState | None, path: Path, before: Callable[[], object] | None,
               pending: list[tuple[torch.Tensor, torch.Tensor]], staged: threading.Event | None, copied: Any,
               ) -> None:  # fmt: skip
        try:
            try:
                for buffer, tensor in pending:  # at the training's priority: the next commit waits for it
                    buffer.copy_(tensor)
            finally:
                if staged is not None:
                    staged.set()
            with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's own niceness; elsewhere as it is
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # training's threads come first
            if copied is not None:
                copied.synchronize()
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
        self._staged = None

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
