"""A TrainLoop step never reads a tensor back to the host, and the epoch line's throughput and peak memory.

Here, the tests in one process; those on 2 ranks (DDP, FSDP) are in tests/ranks/test_host_reads.py. How reads are
counted: tests/support/host_reads.py.
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

import pytest
import torch

from ddpkit import Callback
from tests.builders import digits_loop
from tests.support.host_reads import FULL, HostReads, inked_pixels, reads_per_step, sgd_digits_reads


def test_the_counter_sees_what_a_hand_written_step_reads() -> None:
    """The counter tells a step that reads its loss (``float(loss)``, as ddpkit's did) from one that does not."""
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    with HostReads() as reading:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        float(loss.detach())
        bool(torch.isfinite(loss))
    with HostReads() as quiet:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert sum(reading.reads.values()) == 2, reading.reads
    assert sum(quiet.reads.values()) == 0, quiet.reads


@pytest.mark.parametrize("options", [{}, FULL, {"global_batch_size": 64, **FULL}], ids=["plain", "full", "global"])
def test_one_process_reads_nothing_between_steps(options: dict[str, Any]) -> None:
    per_step, reads = sgd_digits_reads(32, 1, 2, 20, **options)
    assert per_step == 0.0, reads


def test_fp16s_scaler_reads_once_a_step_its_own_check() -> None:
    """``GradScaler.step`` reads whether it found an inf or nan (one read per step, torch's); ddpkit reads no more
    (whether the step was taken comes from the optimizer's step hook, not from the scale)."""
    per_step, reads = sgd_digits_reads(32, 1, 2, 20, precision="16-mixed", gradient_clip_norm=0.3)
    assert per_step == 1.0, reads


def test_a_callback_that_asks_for_the_norm_or_loss_reads_them_once_each() -> None:
    """The norm and the loss stay on the device until a callback reads them; each read is counted, once."""

    class Asks(Callback):
        def on_batch_end(self, train_loop: Any) -> None:
            train_loop.step_metrics["grad_norm"], train_loop.step_metrics["grad_norm"]  # read once, kept
            float(train_loop.step_loss[0])

    per_step, reads = sgd_digits_reads(32, 1, 2, 20, callbacks=[Asks()], gradient_clip_norm=0.3)
    assert per_step == 2.0, reads


class _Measures(Callback):
    """The epoch's training time and items as a callback sees them, and the process's peak RSS around it."""

    def __init__(self) -> None:
        self.began = self.trained = 0.0
        self.items = 0
        self.rss: list[tuple[int, int]] = []

    def on_epoch_begin(self, train_loop: Any) -> None:
        self.began, self.before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def on_batch_end(self, train_loop: Any) -> None:
        self.trained = time.perf_counter()
        self.items += int(train_loop.step_loss[1])

    def on_epoch_end(self, train_loop: Any) -> None:
        self.rss.append((self.before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def test_the_epoch_line_gives_items_per_second_and_peak_memory_as_measured_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    measures = _Measures()
    loop = digits_loop(16)
    with caplog.at_level(logging.INFO, logger="ddpkit.training._run"):
        loop.fit(1, callbacks=[measures])
    speed, memory = loop.history["items_per_second"][0], loop.history["peak_memory_mib"][0]
    assert measures.items == len(loop.train_loader.dataset)
    measured = measures.items / (measures.trained - measures.began)
    assert 0.8 < speed / measured < 1.25, (speed, measured)
    before, after = measures.rss[0]
    assert before / 2**20 <= memory <= after / 2**20
    line = next(record.message for record in caplog.records if record.message.startswith("epoch  1/1"))
    assert f"  {speed:.0f} items/s  peak memory {round(memory)} MiB" in line, line


class _CountsInk(Callback):
    """The tokens of every batch the loop trains, counted apart (each step's batches are the loader's batches)."""

    def __init__(self) -> None:
        self.tokens = 0

    def on_train_begin(self, train_loop: Any) -> None:
        self.tokens = sum(int((inputs > 0).sum()) for inputs, _ in train_loop.train_loader)


def test_tokens_per_second_counts_what_tokens_fn_says_and_reads_nothing_between_steps(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With ``tokens_fn`` the epoch line and the history give tokens/s: tokens / items equals what the test counts
    itself over the same loader, and the step still reads nothing back (the counts stay tensors)."""
    counted = _CountsInk()
    loop = digits_loop(16, tokens_fn=inked_pixels, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))  # Adam reads
    with caplog.at_level(logging.INFO, logger="ddpkit.training._run"):
        per_step, reads = reads_per_step(loop, 1, 2, 20, [counted])
    assert per_step == 0.0, reads
    tokens, items = loop.history["tokens_per_second"][0], loop.history["items_per_second"][0]
    assert tokens / items == pytest.approx(counted.tokens / len(loop.train_loader.dataset), rel=1e-9)
    line = next(record.message for record in caplog.records if record.message.startswith("epoch  1/1"))
    assert f"  {items:.0f} items/s  {tokens:.0f} tokens/s  peak memory" in line, line


def test_tokens_fn_that_returns_no_number_is_refused_naming_what_it_returned() -> None:
    loop = digits_loop(16, tokens_fn=lambda batch: batch[0].shape)
    with pytest.raises(TypeError, match=r"tokens_fn returned Size torch.Size\(\[16, 64\]\).*an int or a one-element"):
        loop.fit(1)


def test_the_epochs_loss_sum_adds_each_batchs_loss_times_its_items_over_many_steps_exactly() -> None:
    """RunState keeps a step's batch losses and adds them to the epoch's sum by the hundred (a step adds no tensor
    operation of its own): over 600 steps of batches of 16 and 7 items, in float32 and bfloat16, ``epoch_sums`` is
    the float64 sum of loss x items, read at any point; a new epoch starts from zero."""
    from ddpkit.training._driver import LossSums
    from ddpkit.training._state import RunState

    state = RunState()
    generator = torch.Generator().manual_seed(0)
    expected, items = 0.0, 0.0
    for step in range(600):
        sums = LossSums()
        for count, dtype in ((16.0, torch.float32), (7.0, torch.bfloat16 if step % 3 else torch.float32)):
            loss = torch.rand((), generator=generator).to(dtype)
            sums.add(loss, count)
            expected, items = expected + float(loss.double()) * count, items + count
        state.count_step(sums)
        if step in (10, 299):  # read part-way: what was counted so far
            assert state.epoch_sums.tolist() == pytest.approx([expected, items], rel=1e-12)
    assert state.epoch_sums.tolist() == pytest.approx([expected, items], rel=1e-12)
    state.begin_epoch()
    assert state.epoch_sums.tolist() == [0.0, 0.0]
