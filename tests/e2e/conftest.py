"""tests/e2e: launcher end-to-end tests, which start fresh processes (schedulers and network namespaces
included). Every test here is marked ``e2e``: ``pytest -m "not e2e"`` leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)
