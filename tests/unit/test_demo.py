"""The main job: the bundled digits data and `ddpkit demo` training with 2 processes.

Here, the tests that need no process; the others are in tests/ranks/test_demo.py and tests/e2e/test_demo.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ddpkit.examples.demo import DemoConfig, train_digits
from ddpkit.examples.digits import digits_datasets, load_digits


def test_bundled_digits_are_the_uci_test_set() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 64)
    assert images.dtype == np.float32
    assert labels.dtype == np.int64
    assert (images.min(), images.max()) == (0.0, 1.0)
    counts = np.bincount(labels)
    assert len(counts) == 10
    assert counts.min() >= 170  # every digit has about 180 samples
    shared = Path(__file__).parents[2] / ".." / "shared" / "data" / "digits.csv.gz"
    if shared.exists():
        bundled = Path(__file__).parents[2] / "src" / "ddpkit" / "examples" / "data" / "digits.csv.gz"
        assert bundled.read_bytes() == shared.read_bytes()


def test_split_is_disjoint_complete_and_reproducible() -> None:
    train, val = digits_datasets(seed=3)
    assert (len(train), len(val)) == (1438, 359)

    def table(*datasets: object) -> np.ndarray:
        rows = np.concatenate([np.column_stack([d.tensors[0].numpy(), d.tensors[1].numpy()]) for d in datasets])  # type: ignore[attr-defined]
        return rows[np.lexsort(rows.T[::-1])]

    images, labels = load_digits()
    full = np.column_stack([images, labels])
    assert np.array_equal(table(train, val), full[np.lexsort(full.T[::-1])]), "every sample exactly once"
    again, _ = digits_datasets(seed=3)
    assert all((a == b).all() for a, b in zip(train.tensors, again.tensors, strict=True))
    other, _ = digits_datasets(seed=4)
    assert not (other.tensors[1] == train.tensors[1]).all()
    with pytest.raises(ValueError, match=r"val_fraction=1.0 must be in \(0, 1\)"):
        digits_datasets(val_fraction=1.0)


def test_training_without_a_process_group_learns_the_digits() -> None:
    result = train_digits(DemoConfig(epochs=5, progress=False))
    assert result.world_size == 1
    assert result.val_total == 359
    assert result.val_accuracy >= 0.9
    assert result.train_losses[-1] < result.train_losses[0] / 4


def test_demo_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="batch_size=0"):
        DemoConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr_schedule='linear': use 'none' or 'cosine'"):
        DemoConfig(lr_schedule="linear")
    with pytest.raises(ValueError, match=r"clip=0\.0 must be > 0"):
        DemoConfig(clip=0.0)
