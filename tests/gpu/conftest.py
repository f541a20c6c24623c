"""Every test here needs CUDA: without it they skip, so that CI (CPU only) stays green.

``tools/gpu-check.sh`` runs them on a GPU machine, with the rest of the CUDA checks.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tools/gpu-check.sh runs these on a GPU machine)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)
