"""TrainLoop's loggers, early stopping and best weights on 2 ranks: one writer, the whole split's numbers, resumable.

Here, the tests that need no process; the others are in tests/ranks/test_training_logs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddpkit.plotting import plot_bandwidth, plot_history


def test_plots_are_pngs_of_the_curves(tmp_path: Path) -> None:
    history = {"train_loss": [1.0, 0.5], "validation_loss": [1.1, 0.6], "validation_accuracy": [0.7, 0.9]}
    assert plot_history(history, tmp_path / "h.png").read_bytes().startswith(b"\x89PNG")
    rows = [("all_reduce", 8, 1e-3), ("all_reduce", 1 << 20, 3e-3), ("all_gather", 1 << 20, 2e-3)]
    assert plot_bandwidth(rows, tmp_path / "sub" / "b.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(ValueError, match="the history is empty"):
        plot_history({}, tmp_path / "empty.png")
