"""What TrainLoop checks and says at each step: a rank that skips DDP's all-reduce, which rank is slowest, and
the epoch's line."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpkit.errors import DDPKitError
from ddpkit.process_group import get_rank
from ddpkit.training._driver import Budget, EpochTotals
from ddpkit.training._state import RunState

__all__ = ["epoch_line", "evaluation_line", "resume_line", "skipped_model_error", "stop_line", "straggler_text"]


def step_name(loop: object, method: str) -> str:
    """``MyLoop.training_step (train.py:12)``: a loop's step method by its class and where it is defined."""
    function = getattr(type(loop), method)
    return f"{type(loop).__name__}.{method}{_where(function)}"


def _where(function: Callable[..., Any]) -> str:
    """`` (file:line)`` of ``function``, or nothing when its source is not found."""
    with contextlib.suppress(TypeError, OSError):
        return f" ({inspect.getsourcefile(function)}:{inspect.getsourcelines(function)[1]})"
    return ""


def skipped_model_error(method: Callable[..., Any], state: RunState, index: int) -> DDPKitError:
    """The error of a rank whose ``training_step`` (``method``, the class's function) did not run the model given
    to it (it would skip the collectives the other ranks wait in: DDP's gradient all-reduce, FSDP's all-gathers
    and reduce-scatters), naming the step and where ``training_step`` is."""
    where = _where(method)
    return DDPKitError(
        f"rank {get_rank()}: training_step{where} did not call the model in step {state.global_step + 1} (epoch "
        f"{state.epoch + 1}, batch {index}), so this rank would skip the collectives of the model's forward and "
        "backward (DDP's gradient all-reduce; a sharded model's all-gathers and reduce-scatters) that the other "
        "ranks wait in: the ranks would go out of step (a hang, or gradients of different steps averaged). "
        "Call the model on every rank in every step; to drop a bad batch, multiply its loss by 0 instead"
    )


def straggler_text(step_times: list[float], names: list[str] | None = None) -> str:
    """``load+forward 4.1-5.2 ms/batch (slowest rank 1)`` for the ranks' mean times per batch (ms), or for the
    processes ``names`` names (``slowest group-1``: replica groups)."""
    slowest = max(range(len(step_times)), key=step_times.__getitem__)
    who = names[slowest] if names else f"rank {slowest}"
    return f"load+forward {min(step_times):.1f}-{max(step_times):.1f} ms/batch (slowest {who})"


def epoch_line(
    epoch: str, loss: float, metrics: dict[str, float], step_times: list[float],
    names: list[str] | None = None, items_per_second: float | None = None, peak_memory: list[int] | None = None,
    tokens_per_second: float | None = None,
) -> str:  # fmt: skip
    """``epoch  2/10  train loss 0.1234  validation accuracy 0.9600  5230 items/s  41840 tokens/s  peak memory
    310-322 MiB/rank (most: rank 1)  load+forward ...`` (``epoch``: ``Budget.epoch_text``; ``names``: whose
    ``step_times`` they are, default ranks 0, 1, ...; ``peak_memory``: bytes, by rank, or this process's alone)."""
    parts = [epoch, f"train loss {loss:.4f}"]
    parts += [f"validation {name} {value:.4f}" for name, value in metrics.items()]
    if items_per_second is not None and items_per_second == items_per_second:  # not nan
        parts.append(f"{items_per_second:.0f} items/s")
    if tokens_per_second is not None and tokens_per_second == tokens_per_second:
        parts.append(f"{tokens_per_second:.0f} tokens/s")
    if peak_memory:
        parts.append(memory_text(peak_memory))
    if len(step_times) > 1:
        parts.append(straggler_text(step_times, names))
    return "  ".join(parts)


def memory_text(peak_memory: list[int]) -> str:
    """``peak memory 310 MiB`` (one process), ``peak memory 310-322 MiB/rank (most: rank 1)``, or ``peak memory 310
    MiB/rank`` when every rank's rounds to the same."""
    mib = [round(b / 2**20) for b in peak_memory]
    if len(mib) == 1:
        return f"peak memory {mib[0]} MiB"
    if min(mib) == max(mib):
        return f"peak memory {mib[0]} MiB/rank"
    most = max(range(len(mib)), key=peak_memory.__getitem__)
    return f"peak memory {min(mib)}-{max(mib)} MiB/rank (most: rank {most})"


def resume_line(state: RunState, checkpoint_dir: Path | None, budget: Budget) -> str:
    """What a ``TrainLoop`` that found a checkpoint in ``checkpoint_dir`` does with it: resume, or nothing when
    it is finished (``state``: the run state restored from it; ``budget``: the fit's)."""
    epoch, steps = state.epoch, state.global_step
    if budget.max_steps is not None and steps >= budget.max_steps:
        return (
            f"already trained {steps} of max_steps={budget.max_steps} optimizer steps in {checkpoint_dir}; nothing "
            "to do: delete it, pass a new checkpoint_dir, or ask for more steps"
        )
    if budget.num_epochs is not None and epoch >= budget.num_epochs:
        return (
            f"already trained {epoch} of {budget.num_epochs} epochs in {checkpoint_dir}; nothing to do: delete it, "
            "pass a new checkpoint_dir, or ask for more epochs"
        )
    position = state.resume_position
    where = f", {position} entries into it" if position else ""
    of = f" of {budget.max_steps}" if budget.max_steps is not None else ""
    return (
        f"resuming from {checkpoint_dir}: {budget.epoch_text(epoch).replace('  ', ' ')}{where}, "
        f"after {steps}{of} optimizer steps"
    )


def evaluation_line(epoch: int, step: int, metrics: dict[str, float]) -> str:
    """``step 200 (epoch 3)  validation loss 0.1234  validation accuracy 0.9600``: an evaluation after a step
    (``epoch`` 0-based)."""
    return "  ".join([f"step {step} (epoch {epoch + 1})", *(f"validation {n} {v:.4f}" for n, v in metrics.items())])


def stop_line(state: RunState, budget: Budget, totals: EpochTotals, items_per_second: float) -> str:
    """``epoch  3/10  stopped after step 30 (max_steps=30)  train loss 0.4321 over its first 480 items  5230
    items/s``: a run that ends inside an epoch (``totals``: the epoch's so far)."""
    why = "max_steps" if budget.max_steps is not None and state.global_step >= budget.max_steps else "should_stop"
    reason = f"max_steps={budget.max_steps}" if why == "max_steps" else "a callback set should_stop"
    parts = [
        budget.epoch_text(state.epoch),
        f"stopped after step {state.global_step} ({reason})",
        f"train loss {totals.loss:.4f} over its first {totals.items:.0f} items",
    ]
    if items_per_second == items_per_second:  # not nan
        parts.append(f"{items_per_second:.0f} items/s")
    return "  ".join(parts)
