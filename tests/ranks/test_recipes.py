"""TrainLoop's training recipes: learning-rate schedules, mixed precision, gradient clipping, torch.compile.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_recipes.py and
tests/e2e/test_recipes.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import Callback, TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ddpkit.examples.digits import digits_datasets
from ddpkit.testing import run_parallel
from tests.builders import digits_model
from tests.helpers import StopAfter
from tests.support.recipes import OPTIONS, _fit, _loop, _Record

# --- run in the workers (top level: pickled by reference) -----------------------------------


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# --- each option alone and all together: 2 ranks equal one process -------------------------------


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_on_two_ranks_equals_one_process(option: str) -> None:
    epochs = 3 if option == "plateau" else 2  # it halves the learning rate after epoch 2 (for epoch 3)
    (weights, history, steps), other = run_parallel(_fit, 32, option, epochs, world_size=2, timeout=120)
    single, single_history, single_steps = _fit(64, option, epochs)
    assert _max_difference(weights, other[0]) == 0.0, "the ranks hold the same weights"
    low_precision = OPTIONS[option].get("precision", "32") != "32"
    tolerance = 1e-5
    if low_precision:
        # bf16 keeps 8 bits of mantissa, fp16 11: a rank's 32 rows and one process's 64 round differently in
        # the forward and backward, and 46 steps of SGD with momentum (lr 0.2) carry that on (bf16 here: ~0.02 at
        # most, ~0.002 on average). The bound is twice what that rounding itself moves (the distance to the same
        # run in float32: ~0.06 for bf16, ~0.02 for fp16 here), far below a run that differs (~0.9).
        tolerance = 2 * _max_difference(_fit(64, option, epochs, precision="32")[0], single)
    assert _max_difference(weights, single) < tolerance
    different = _fit(32, option, epochs, global_batch_size=None)[0]  # twice the steps
    assert _max_difference(different, single) > 5 * tolerance, "the comparison tells runs apart"
    if option != "compile":  # compiling changes no number
        assert _max_difference(_fit(64, "", epochs)[0], single) > 0.0, "the option changed the training"
    if "lr_scheduler" in OPTIONS[option]:
        assert history["lr"] + history["lr_after"] == pytest.approx(
            single_history["lr"] + single_history["lr_after"], rel=1e-6
        )
        assert [s["lr"] for s in steps] == pytest.approx([s["lr"] for s in single_steps], rel=1e-6)
        assert len(set(history["lr"] + history["lr_after"])) > 1, "the learning rate moved"
    if "gradient_clip_norm" in OPTIONS[option] or "gradient_clip_val" in OPTIONS[option]:
        norms = [s["grad_norm"] for s in steps]
        # bf16's machine epsilon is 2**-7: norms of gradients computed in it agree to about 1%.
        assert norms == pytest.approx([s["grad_norm"] for s in single_steps], rel=2e-2 if low_precision else 1e-4)
        assert max(norms) > OPTIONS[option].get("gradient_clip_norm", 0.0), "some steps were clipped"
    if option == "fp16":
        assert history["skipped_steps"] == single_history["skipped_steps"]


def _first_step(batch_size: int, option: str, **kwargs: Any) -> tuple[float, float]:
    """The first step's gradient norm as recorded, and how far that step moved the weights (their 2-norm)."""
    loop = _loop(batch_size, option, **kwargs)
    before = torch.cat([p.detach().clone().reshape(-1) for p in loop.model.parameters()])
    with contextlib.suppress(KeyboardInterrupt):
        loop.fit(1, callbacks=[StopAfter(1)])
    after = torch.cat([p.detach().reshape(-1) for p in loop.model.parameters()])
    return loop.step_metrics["grad_norm"], float((after - before).norm())


@pytest.mark.parametrize("option", ["clip-norm", "fp16-clip-accumulated"])
def test_the_first_step_moves_the_weights_by_the_clipped_all_reduced_gradient(option: str) -> None:
    """SGD's first step moves the weights by lr x the clipped gradient: its norm is lr x 0.3 when the all-reduced
    gradient's norm (the one recorded; with fp16 unscaled, so about the float32 one) is larger."""
    (norm, moved), _ = run_parallel(_first_step, 32, option, timeout=60)
    unclipped, moved_unclipped = _first_step(64, option, precision="32", gradient_clip_norm=1e9)
    assert norm > 0.3, "the gradient was clipped"
    assert moved == pytest.approx(0.2 * 0.3, rel=1e-3)
    assert norm == pytest.approx(unclipped, rel=1e-2), "the recorded norm is the all-reduced, unscaled one"
    assert moved_unclipped == pytest.approx(0.2 * unclipped, rel=1e-3), "unclipped, the step is lr x the norm"


# --- resume and resize ------------------------------------------------------------------------------


def _resumable(directory: str, stop: int | None, option: str, **kwargs: Any) -> tuple[Any, ...]:
    loop, record = _loop(32, option, checkpoint_dir=directory, checkpoint_every=4, **kwargs), _Record()
    try:
        loop.fit(2, callbacks=[record, *([StopAfter(stop)] if stop else [])])
    except KeyboardInterrupt as interrupt:
        return str(interrupt), None, record.steps
    scaler = loop.recipe.scaler.state_dict() if loop.recipe.scaler is not None else None
    return {k: v.clone() for k, v in loop.model.state_dict().items()}, (dict(loop.history), scaler), record.steps


def test_a_run_resumed_mid_epoch_with_a_scheduler_and_fp16_is_bit_identical(tmp_path: Path) -> None:
    uninterrupted = run_parallel(_resumable, str(tmp_path / "a"), None, "fp16-cosine", timeout=120)
    assert (
        run_parallel(_resumable, str(tmp_path / "b"), 10, "fp16-cosine", timeout=120)[0][0] == "stopped after step 10"
    )
    saved = load_checkpoint(tmp_path / "b" / CHECKPOINT_FILE)
    assert saved["global_step"] == 8
    assert set(saved["recipe"]) == {"lr_scheduler", "grad_scaler"}, "the scheduler and the scaler are in it"
    resumed = run_parallel(_resumable, str(tmp_path / "b"), None, "fp16-cosine", timeout=120)
    weights, (history, scaler), steps = resumed[0]
    expected_history = uninterrupted[0][1][0]
    assert all(torch.equal(weights[k], uninterrupted[0][0][k]) for k in weights), "bit-identical"
    for name in ("lr", "skipped_steps", "validation_loss", "validation_accuracy"):
        assert history[name] == expected_history[name], name
    assert history["train_loss"] == pytest.approx(expected_history["train_loss"], rel=1e-12)
    assert scaler == uninterrupted[0][1][1]
    assert steps == uninterrupted[0][2][8:], "steps 9 on have the uninterrupted learning rates"


def test_a_resize_with_a_global_batch_keeps_the_learning_rate_of_every_step(tmp_path: Path) -> None:
    """Stopped on 2 ranks after step 10 (checkpoint at 8), resumed on 1: steps 9 on have the learning rates and
    weights of an unresized run."""
    stopped = run_parallel(_resumable, str(tmp_path / "a"), 10, "cosine-per-step", global_batch_size=64, timeout=120)
    assert stopped[0][0] == "stopped after step 10"
    resumed = _resumable(str(tmp_path / "a"), None, "cosine-per-step", global_batch_size=64)
    unresized = run_parallel(
        _resumable, str(tmp_path / "b"), None, "cosine-per-step", global_batch_size=64, timeout=120
    )
    assert [s["lr"] for s in resumed[2]] == pytest.approx([s["lr"] for s in unresized[0][2][8:]], rel=1e-12)
    assert [s["step"] for s in resumed[2]] == [s["step"] for s in unresized[0][2][8:]]
    assert _max_difference(resumed[0], unresized[0][0]) < 1e-5


# --- fp16: a step with inf gradients is skipped on every rank -----------------------------------------


class _InfOnRankOne(TrainLoop):
    """Rank 1's loss is inf in step 3: DDP's all-reduce spreads it to every rank's gradients."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        loss = super().training_step(model, batch)
        if self.global_step == 2 and dist.get_rank() == 1:
            loss = loss * float("inf")
        return loss


def _inf_step() -> tuple[dict[str, torch.Tensor], list[float], list[dict[str, float]], float]:
    train, _ = digits_datasets(seed=0)
    model = digits_model()
    loop = _InfOnRankOne(model, DataLoader(train, batch_size=32, shuffle=True), progress=False,
                         optimizer=torch.optim.SGD(model.parameters(), lr=0.1), precision="16-mixed")  # fmt: skip
    weights: list[dict[str, torch.Tensor]] = []

    class Snapshot(Callback):
        def on_batch_end(self, train_loop: Any) -> None:
            weights.append({k: v.clone() for k, v in train_loop.model.state_dict().items()})

    loop.fit(1, callbacks=[Snapshot()])
    assert loop.recipe.scaler is not None
    changed = [_max_difference(weights[i], weights[i + 1]) for i in range(4)]
    return weights[-1], changed, loop.history["skipped_steps"], loop.recipe.scaler.get_scale()


def test_an_fp16_step_with_inf_gradients_is_skipped_on_every_rank() -> None:
    results = run_parallel(_inf_step, timeout=60)
    for _, changed, skipped, scale in results:
        assert changed[1] == 0.0, "step 3 (between the snapshots after steps 2 and 3) changed nothing"
        assert min(changed[0], changed[2], changed[3]) > 0.0, "the steps around it trained"
        assert skipped == [1.0]
        assert scale == 65536.0 / 2, "the scale backed off once"
    assert _max_difference(results[0][0], results[1][0]) == 0.0, "the ranks still hold the same weights"
