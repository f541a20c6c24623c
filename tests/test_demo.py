"""The main job: the bundled digits data and `ddpkit demo` training with 2 processes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ddpkit.examples.demo import DemoConfig, DemoResult, build_model, train_digits
from ddpkit.examples.digits import digits_datasets, load_digits
from ddpkit.testing import run_parallel


def test_bundled_digits_are_the_uci_test_set() -> None:
    images, labels = load_digits()
    assert images.shape == (1797, 64)
    assert images.dtype == np.float32
    assert labels.dtype == np.int64
    assert (images.min(), images.max()) == (0.0, 1.0)
    counts = np.bincount(labels)
    assert len(counts) == 10
    assert counts.min() >= 170  # every digit has about 180 samples
    shared = Path(__file__).parents[1] / ".." / "shared" / "data" / "digits.csv.gz"
    if shared.exists():
        bundled = Path(__file__).parents[1] / "src" / "ddpkit" / "examples" / "data" / "digits.csv.gz"
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


def test_the_demo_with_a_cosine_schedule_bf16_and_clipping_learns_on_two_ranks() -> None:
    """``ddpkit demo --lr-schedule cosine --precision bf16-mixed --clip 1.0``'s training, in the pool."""
    config = DemoConfig(epochs=3, progress=False, lr_schedule="cosine", precision="bf16-mixed", clip=1.0)
    results = run_parallel(_train, config, world_size=2, timeout=60)
    assert results[0].val_accuracy == results[1].val_accuracy >= 0.9
    assert results[0].train_losses[-1] < results[0].train_losses[0] / 2


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_ddpkit_demo_trains_on_two_processes_to_90_percent() -> None:
    """The README's main job, through the installed console script."""
    command = shutil.which("ddpkit", path=str(Path(sys.executable).parent))
    assert command is not None, "the ddpkit console script is not installed next to this Python"
    done = subprocess.run([command, "demo"], capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr
    line = (
        r"^epoch +(\d+)/10 +train loss [\d.]+ +validation loss [\d.]+ +validation accuracy [\d.]+ +"
        r"load\+forward [\d.]+-[\d.]+ ms/batch \(slowest rank [01]\)$"
    )
    epochs = re.findall(line, done.stdout, re.MULTILINE)
    assert epochs == [str(e) for e in range(1, 11)], "rank 0, and only rank 0, prints each epoch once"
    summary = re.search(r"ddpkit demo: 2 processes \(gloo\), 10 epochs, .*validation accuracy ([\d.]+) "
                        r"\((\d+)/359\)", done.stdout)  # fmt: skip
    assert summary is not None, done.stdout
    assert float(summary.group(1)) >= 0.90


def _train(config: DemoConfig) -> DemoResult:
    return train_digits(config)


def test_distributed_validation_accuracy_equals_one_process_on_the_same_weights() -> None:
    """3 ranks, 359 validation samples: padded shards, yet not one duplicate or miss in the count."""
    results = run_parallel(_train, DemoConfig(epochs=2, progress=False), world_size=3, timeout=60)
    result = results[0]
    assert [r.val_correct for r in results] == [result.val_correct] * 3
    assert result.val_total == 359
    model = build_model()
    model.load_state_dict(result.weights)
    _, val = digits_datasets(seed=0)
    images, labels = val.tensors
    with torch.no_grad():
        single = int((model(images).argmax(dim=1) == labels).sum())
    assert result.val_correct == single
