"""tests/unit: no processes. A test here that starts one (a subprocess, a multiprocessing process, a task of the
session pool) fails, naming what it started."""

from __future__ import annotations

import pytest

from tests.helpers import no_processes


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    no_processes(monkeypatch, "tests/unit", pool=False)
