"""A TrainLoop step on 2 ranks (DDP, FSDP) never reads a tensor back to the host; each rank's peak memory on the
epoch line.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_host_reads.py.
"""

from __future__ import annotations

import logging
import re
import resource
from pathlib import Path
from typing import Any

import pytest

from ddpkit import Callback
from ddpkit.testing import run_parallel
from tests.builders import digits_loop
from tests.support.host_reads import FULL, inked_pixels, sgd_digits_reads, sharded_reads


@pytest.mark.parametrize("options", [{}, FULL, {"global_batch_size": 64, **FULL}], ids=["plain", "full", "global"])
def test_ddp_on_two_ranks_reads_nothing_between_steps(options: dict[str, Any]) -> None:
    for per_step, reads in run_parallel(sgd_digits_reads, 16, 1, 2, 20, world_size=2, timeout=120, **options):
        assert per_step == 0.0, reads


class _Watching(Callback):
    def on_batch_end(self, train_loop: Any) -> None:
        self.active = train_loop.preemption.active


def _slurm_task_reads(directory: str) -> tuple[float, dict[str, int], bool]:
    """Reads per step of a TrainLoop with a checkpoint_dir in a SLURM task (SLURM's signals watched), and whether
    it watched them."""
    import os

    import torch.distributed as dist

    rank = dist.get_rank()
    task = {"SLURM_JOB_ID": "41", "SLURM_JOB_NAME": "digits", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost"}  # fmt: skip
    saved = {name: os.environ.get(name) for name in task}
    os.environ.update(task)
    try:
        watching = _Watching()
        per_step, reads = sgd_digits_reads(16, 1, 2, 20, [watching], checkpoint_dir=directory, checkpoint_every=1000)
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return per_step, reads, watching.active


def test_a_slurm_task_agrees_on_signals_without_reading_between_steps(tmp_path: Path) -> None:
    """SLURM's signals are agreed on every step (an all-reduce of a CPU flag, waited for a step later)."""
    for per_step, reads, watching in run_parallel(_slurm_task_reads, str(tmp_path), world_size=2, timeout=120):
        assert watching, "the loop watched SLURM's signals"
        assert per_step == 0.0, reads


def test_fsdp_on_two_ranks_reads_nothing_between_steps() -> None:
    """The sharded stack (a global batch of 24 in batches of 4: 3 steps of 2 micro-batches per rank), with clipping,
    bf16 and a per-step schedule."""
    for per_step, reads in run_parallel(sharded_reads, 2, 6, world_size=2, timeout=120, **FULL):
        assert per_step == 0.0, reads


class _PeakRSS(Callback):
    def on_epoch_begin(self, train_loop: Any) -> None:
        self.before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def on_epoch_end(self, train_loop: Any) -> None:
        self.after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peaks_and_line() -> tuple[int, int, str | None]:
    """This rank's peak RSS before and after the epoch, and the epoch line rank 0 logged."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("ddpkit.training._run")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        peaks = _PeakRSS()
        digits_loop(16).fit(1, callbacks=[peaks])
    finally:
        logger.removeHandler(handler)
    return peaks.before, peaks.after, next((line for line in lines if line.startswith("epoch")), None)


def test_the_epoch_line_names_each_ranks_peak_memory_and_the_rank_that_holds_most() -> None:
    """Each rank's peak (its resident set size at most, on the CPU) lies between what that rank measured itself
    before and after the epoch."""
    (before0, after0, line), (before1, after1, other) = run_parallel(_peaks_and_line, world_size=2, timeout=120)
    assert other is None, "rank 0 alone writes the line"
    found = re.search(r"  \d+ items/s  peak memory (\d+)(?:-(\d+))? MiB/rank(?: \(most: rank (\d)\))?", line or "")
    assert found is not None, line
    low, high, most = int(found[1]), int(found[2] or found[1]), int(found[3] or 0)
    mine = {0: high if most == 0 else low, 1: high if most == 1 else low}
    assert round(before0 / 2**20) <= mine[0] <= round(after0 / 2**20), line
    assert round(before1 / 2**20) <= mine[1] <= round(after1 / 2**20), line


def _tokens_and_items(batch_size: int) -> tuple[float, float, int, int]:
    """tokens/s and items/s of an epoch on this rank's view (every rank's totals), and the inked pixels and items of
    the batches this rank trained, counted apart."""
    seen = {"tokens": 0, "items": 0}

    class _Counts(Callback):
        def on_epoch_begin(self, train_loop: Any) -> None:
            for inputs, _ in train_loop.train_loader:  # the rank's shard, as it trains it
                seen["tokens"] += int((inputs > 0).sum())
                seen["items"] += len(inputs)

    loop = digits_loop(batch_size, tokens_fn=inked_pixels)
    loop.fit(1, callbacks=[_Counts()])
    return loop.history["tokens_per_second"][0], loop.history["items_per_second"][0], seen["tokens"], seen["items"]


def test_tokens_per_second_sums_every_ranks_tokens() -> None:
    results = run_parallel(_tokens_and_items, 16, world_size=2, timeout=120)
    tokens = sum(result[2] for result in results)
    items = sum(result[3] for result in results)
    for tokens_per_second, items_per_second, _, _ in results:
        assert tokens_per_second / items_per_second == pytest.approx(tokens / items, rel=1e-9)
