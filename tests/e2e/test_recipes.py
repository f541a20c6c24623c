"""TrainLoop's training recipes: learning-rate schedules, mixed precision, gradient clipping, torch.compile.

Here, the tests that start fresh processes; the others are in tests/unit/test_recipes.py and
tests/ranks/test_recipes.py.
"""

from __future__ import annotations

import pytest

from tests.support.recipes import _fit, _loop

# --- run in the workers (top level: pickled by reference) -----------------------------------


# --- resume and resize ------------------------------------------------------------------------------


# --- through fit_distributed: the callable scheduler is built in each worker -----------------------------


@pytest.mark.timeout(300)
def test_a_callable_scheduler_goes_through_fit_distributed() -> None:
    """The loop is pickled to 2 new processes; each builds the scheduler on its own optimizer, and the caller
    gets rank 0's learning rates: those of one process with the doubled batch."""
    loop = _loop(32, "cosine-per-step")
    assert loop.recipe.scheduler is None, "a callable: nothing is built before the workers"
    history = loop.fit_distributed(2, num_processes=2)
    _, single_history, single_steps = _fit(64, "cosine-per-step")
    assert history["lr"] == pytest.approx(single_history["lr"], rel=1e-6)
    assert loop.step_metrics["lr"] == pytest.approx(single_steps[-1]["lr"], rel=1e-6)
    assert loop.global_step == len(single_steps) == 46
