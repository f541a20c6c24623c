"""What several test modules share: hf streams."""

from __future__ import annotations

from typing import Any

import pytest

datasets = pytest.importorskip("datasets")


ITEMS = 101


def _numbers(shards: int) -> Any:
    return datasets.Dataset.from_dict({"x": list(range(ITEMS))}).to_iterable_dataset(num_shards=shards)
