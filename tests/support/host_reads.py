"""Counting the host's reads of tensors inside a TrainLoop's steps (tests/unit and tests/ranks test_host_reads).

Every ``.item()``, ``float()``, ``int()`` or ``bool()`` of a tensor goes through the operator
``aten._local_scalar_dense``; ``nonzero`` (boolean indexing, ``torch.where`` with one argument) and ``equal`` return
something whose size or value the host must know. On a GPU each one makes the CPU wait until every kernel queued
before it has run (torch's ``set_sync_debug_mode("error")`` raises there): counted on CPU, they are what a GPU run
would wait for. ``Tensor.tolist()`` does not go through the dispatcher: ddpkit's own code never calls it on a
device tensor inside a step (``tests/unit/test_architecture.py`` cannot see it either; the GPU check does).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddpkit import Callback
from tests.support.recipes import warmup_cosine

__all__ = [
    "FULL", "CountReadsBetweenSteps", "HostReads", "inked_pixels", "reads_per_step", "sgd_digits_reads", "sharded_reads"
]  # fmt: skip

#: Clipping (its norm), bf16 and a per-step schedule: what a step does besides the loss.
FULL = {
    "gradient_clip_norm": 0.3, "precision": "bf16-mixed", "lr_scheduler_interval": "step",
    "lr_scheduler": functools.partial(warmup_cosine, warmup=5, total=40),
}  # fmt: skip

_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default", "aten.is_nonzero.default"}


class HostReads(TorchDispatchMode):
    """A dispatch mode that counts the operators that read a tensor back to the host (see the module docstring),
    by name, in :attr:`reads`."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in _READS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


class CountReadsBetweenSteps(Callback):
    """Counts the host reads of the steps after step ``first`` up to step ``last`` (optimizer steps, 1-based) of a
    ``TrainLoop``: the mode is entered at ``on_batch_end`` of step ``first`` and left at that of step ``last``, so
    what is counted is ``last - first`` whole steps (loading, forward, backward, reduction, optimizer step, the
    loop's own bookkeeping), and nothing of an epoch's end."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.mode: HostReads | None = None
        self.reads: Counter[str] = Counter()
        self.steps = 0

    def on_batch_end(self, train_loop: Any) -> None:
        step = train_loop.global_step
        if step == self.first:
            self.mode = HostReads()
            self.mode.__enter__()
        elif step == self.last and self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.reads, self.steps, self.mode = self.mode.reads, self.last - self.first, None

    def per_step(self) -> float:
        """Reads per step counted (after step ``last``)."""
        assert self.steps, f"the run did not reach step {self.last}"
        return sum(self.reads.values()) / self.steps


def reads_per_step(
    loop: Any, epochs: int, first: int, last: int, callbacks: list[Callback] | None = None
) -> tuple[float, dict[str, int]]:
    """Fit ``loop`` for ``epochs`` counting the reads between steps ``first`` and ``last``: per step, and by
    operator."""
    counter = CountReadsBetweenSteps(first, last)
    loop.fit(epochs, callbacks=[*(callbacks or []), counter])
    return counter.per_step(), dict(counter.reads)


def sgd_digits_reads(
    batch_size: int, epochs: int, first: int, last: int, callbacks: list[Callback] | None = None, **options: Any
) -> tuple[float, dict[str, int]]:
    """Reads per step of the digits TrainLoop with SGD (momentum 0.9): torch's Adam on the CPU reads its step count,
    a CPU tensor whatever the device (no wait for a GPU), which would hide ours."""
    from tests.builders import digits_loop

    loop = digits_loop(batch_size, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **options)
    return reads_per_step(loop, epochs, first, last, callbacks)


def sharded_reads(first: int, last: int, **options: Any) -> tuple[float, dict[str, int]]:
    """Reads per step of the sharded stack's TrainLoop (``FSDPPlugin``) with SGD."""
    from tests.support.sharded import Stack, sharded_loop

    model = Stack()
    loop = sharded_loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), **options)
    return reads_per_step(loop, 1, first, last)


def inked_pixels(batch: Any) -> torch.Tensor:
    """A digits batch's "tokens" for ``TrainLoop(tokens_fn=...)``: its inked pixels (a tensor on the batch's
    device)."""
    return (batch[0] > 0).sum()
