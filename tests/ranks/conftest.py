"""tests/ranks: the ranks of each test run in the session pool (``ddpkit.testing.run_parallel``), or a rank's own
DataLoader workers; a test here that starts any other process (a subprocess, a launcher's workers) fails, naming
what it started."""

from __future__ import annotations

import pytest

from tests.helpers import no_processes


@pytest.fixture(autouse=True)
def _only_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    no_processes(monkeypatch, "tests/ranks", pool=True)
