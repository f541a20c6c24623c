"""The session pool behind run_parallel: results per rank, errors with their rank, no hangs.

Here, the tests that need no process; the others are in tests/ranks/test_testing.py.
"""

from __future__ import annotations

import pytest

from ddpkit.testing import run_parallel
from tests.support.testing import _placement


def test_unpicklable_function_is_rejected_in_the_caller() -> None:
    with pytest.raises(TypeError, match="top level of a module"):
        run_parallel(lambda: 1)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_parallel(_placement, 0, world_size=0)
    with pytest.raises(ValueError, match="timeout=0"):
        run_parallel(_placement, 0, timeout=0)
