"""Elastic training: a global batch kept on any world size, epochs resumed in entries of the global order.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_elastic.py and
tests/e2e/test_elastic.py.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint
from ddpkit.examples.elastic import (
    RecordSteps,
    elastic_train_loop,
    parse_args,
    recorded_steps,
    samples_per_epoch,
)
from ddpkit.testing import run_parallel
from tests.builders import digits_loop, digits_model
from tests.helpers import StopAfter
from tests.support.elastic import _expected_epochs, _max_difference, _refused

# --- training on 1, 2 and 3 ranks ----------------------------------------------------------------


def _global_fit(batch: int, global_batch: int, samples: int | None = None, epochs: int = 2) -> dict[str, Any]:
    loop = digits_loop(batch, samples=samples, optimizer=functools.partial(torch.optim.Adam, lr=0.01),
                       global_batch_size=global_batch)  # fmt: skip
    history = loop.fit(epochs)
    return {"weights": {k: v.clone() for k, v in loop.model.state_dict().items()}, "history": history}


@pytest.mark.parametrize("samples", [None, 64 * 5 + 1], ids=["1438-samples", "321-samples"])
def test_a_global_batch_trains_the_same_on_one_two_and_three_ranks(samples: int | None) -> None:
    """1438 = 22 x 64 + 30: a short last step; 321 = 5 x 64 + 1: on 2 ranks rank 1 has no batch in it (it
    still takes part in the step's all-reduce)."""
    alone = _global_fit(32, 64, samples)
    two = run_parallel(_global_fit, 32, 64, samples, world_size=2, timeout=60)
    assert _max_difference(two[0]["weights"], two[1]["weights"]) == 0.0
    assert _max_difference(two[0]["weights"], alone["weights"]) < 1e-5
    assert two[0]["history"]["train_loss"] == pytest.approx(alone["history"]["train_loss"], rel=1e-6)
    assert two[0]["history"]["validation_accuracy"] == alone["history"]["validation_accuracy"]
    three = run_parallel(_global_fit, 16, 96, samples, world_size=3, timeout=60)
    assert _max_difference(three[2]["weights"], _global_fit(16, 96, samples)["weights"]) < 1e-5
    assert _max_difference(_global_fit(32, 32, samples)["weights"], alone["weights"]) > 1e-3, "tells runs apart"


def test_a_world_size_that_cannot_reach_it_raises_on_every_rank() -> None:
    messages = run_parallel(_refused, 64, world_size=3, timeout=60)
    assert all("cannot be reached on 3 rank(s)" in m and "runs on 1, 2 rank(s)" in m for m in messages), messages


# --- resuming on another number of ranks ----------------------------------------------------------


def _elastic_args(directory: Path, sampler: str, **more: Any) -> argparse.Namespace:
    args = parse_args(["--checkpoint-dir", str(directory / "checkpoints"), "--record", str(directory / "record"),
                       "--sampler", sampler, "--batch-size", "16", "--global-batch-size", "96",
                       "--checkpoint-every", "4", "--epochs", "2"])  # fmt: skip
    vars(args).update(more)
    return args


def _elastic_fit(args: argparse.Namespace, stop: int | None = None) -> dict[str, torch.Tensor] | str:
    loop = elastic_train_loop(args)
    try:
        loop.fit(args.epochs, callbacks=[RecordSteps(), *([StopAfter(stop)] if stop else [])])
    except KeyboardInterrupt as interrupt:
        return str(interrupt)
    return {k: v.clone() for k, v in loop.model.state_dict().items()}


@pytest.mark.parametrize("sampler", ["items", "pk"])
@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3)])
def test_a_half_done_epoch_resumes_on_another_number_of_ranks(
    tmp_path: Path, sampler: str, before: int, after: int
) -> None:
    """Stop after step 10 of 2 x 15 (checkpoint at step 8, mid-epoch), resume on another world size: every
    training sample is used once per epoch, and the weights are those of an uninterrupted one-process run."""
    args = _elastic_args(tmp_path, sampler)
    stopped = run_parallel(_elastic_fit, args, 10, world_size=before, timeout=60)
    assert stopped[0] == "stopped after step 10"
    checkpoint = load_checkpoint(tmp_path / "checkpoints" / CHECKPOINT_FILE)
    assert (checkpoint["global_step"], checkpoint["epoch"], checkpoint["world_size"]) == (8, 0, before)
    assert checkpoint["position"] == 8 * (96 if sampler == "items" else 96 // 16), "entries of the global order"
    resumed = run_parallel(_elastic_fit, args, world_size=after, timeout=60)
    steps = recorded_steps(tmp_path / "record")
    assert {len(steps[s]) for s in range(1, 9)} == {before}, "steps 1-8 count as the first run did them"
    assert {len(steps[s]) for s in range(9, len(steps) + 1)} == {after}, "steps 9 and 10 were done again"
    assert samples_per_epoch(tmp_path / "record") == _expected_epochs(args, 2)
    reference = _elastic_fit(_elastic_args(tmp_path / "alone", sampler))
    assert isinstance(reference, dict)
    assert isinstance(resumed[0], dict)
    assert _max_difference(resumed[0], reference) < 1e-5


def _dropout_fit(directory: str, stop: int | None) -> dict[str, torch.Tensor] | str:
    model = digits_model(dropout=0.3)
    loop = digits_loop(model=model, validation_batch_size=None, checkpoint_dir=directory, checkpoint_every=4,
                       global_batch_size=64)  # fmt: skip
    try:
        loop.fit(2, callbacks=[StopAfter(stop)] if stop else None)
    except KeyboardInterrupt as interrupt:
        return str(interrupt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_with_dropout_a_run_resumed_on_as_many_ranks_is_bit_identical(tmp_path: Path) -> None:
    """Each batch's random numbers are seeded from its position in the epoch, not from the run's history."""
    uninterrupted = run_parallel(_dropout_fit, str(tmp_path / "a"), None, timeout=60)
    assert run_parallel(_dropout_fit, str(tmp_path / "b"), 10, timeout=60)[0] == "stopped after step 10"
    resumed = run_parallel(_dropout_fit, str(tmp_path / "b"), None, timeout=60)
    assert all(torch.equal(resumed[0][k], uninterrupted[0][k]) for k in uninterrupted[0])  # type: ignore[index]
    alone = _dropout_fit(str(tmp_path / "c"), None)
    assert isinstance(alone, dict)
    assert _max_difference(alone, uninterrupted[0]) > 1e-4, "dropout draws per batch: one rank draws otherwise"


def _accumulating_fit(directory: str, stop: int | None) -> tuple[str, list[str]]:
    loop = digits_loop(validation_batch_size=None, checkpoint_dir=directory, checkpoint_every=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            loop.fit(2, callbacks=[StopAfter(stop)] if stop else None)
        except KeyboardInterrupt as interrupt:
            return str(interrupt), []
    return f"finished at step {loop.global_step}", [str(w.message) for w in caught if w.category is RuntimeWarning]


def test_without_a_global_batch_a_resize_warns_and_goes_on_with_what_is_left(tmp_path: Path) -> None:
    """23 steps per epoch on 2 ranks (1438 / 64); stopped after step 6 (checkpoint at 4: 256 entries done); on 3
    ranks the rest of epoch 0 is 1182 entries: 13 batches of 32 per rank (padded), then 15 per epoch."""
    stopped = run_parallel(_accumulating_fit, str(tmp_path), 6, world_size=2, timeout=60)
    assert stopped[0] == ("stopped after step 6", [])
    finished = run_parallel(_accumulating_fit, str(tmp_path), None, world_size=3, timeout=60)
    assert [outcome for outcome, _ in finished] == ["finished at step 32"] * 3
    assert all(len(said) == 1 and "Give TrainLoop a global_batch_size" in said[0] for _, said in finished)
