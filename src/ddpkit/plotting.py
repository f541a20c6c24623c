"""PNG plots with matplotlib (``pip install matplotlib``, ddpkit's ``plot`` extra): a training history and
``ddpkit doctor``'s bandwidth."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["plot_bandwidth", "plot_history"]


def _figure(width: float, height: float) -> Any:
    """A matplotlib ``Figure`` not tied to pyplot (the user's backend and open figures stay as they are)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install matplotlib (ddpkit's plot extra)") from exc
    return Figure(figsize=(width, height))


def _save(figure: Any, path: str | os.PathLike[str]) -> Path:
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target


def plot_history(history: Mapping[str, Sequence[float]], path: str | os.PathLike[str]) -> Path:
    """Write a PNG of every curve of a ``TrainLoop.history`` against the epoch; its path.

    Losses (names ending in ``loss``) share the first panel; every other metric
    gets a panel of its own.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the history is empty.
    """
    curves = {name: list(values) for name, values in history.items() if len(values)}
    if not curves:
        raise ValueError("the history is empty: train at least one epoch before plotting it")
    losses = [name for name in curves if name.endswith("loss")]
    panels = ([losses] if losses else []) + [[name] for name in curves if name not in losses]
    figure = _figure(4.5 * len(panels), 3.5)
    from matplotlib.ticker import MaxNLocator

    axes = figure.subplots(1, len(panels), squeeze=False)
    for axis, names in zip(axes[0], panels, strict=True):
        for name in names:
            epochs = range(1, len(curves[name]) + 1)
            axis.plot(epochs, curves[name], marker="o", markersize=3, label=name)
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_title("loss" if names is losses else names[0])
        axis.grid(alpha=0.3)
        axis.legend()
    return _save(figure, path)


def plot_bandwidth(rows: Sequence[tuple[str, int, float]], path: str | os.PathLike[str]) -> Path:
    """Write a PNG of each collective's bus bandwidth against the message size; its path.

    Args:
        rows: ``(operation, bytes per rank, seconds per operation)``.

    Raises:
        ImportError: matplotlib is not installed.
    """
    figure = _figure(6, 4)
    axis = figure.subplots()
    for operation in dict.fromkeys(op for op, _, _ in rows):
        points = sorted((size, size / seconds / 1e9) for op, size, seconds in rows if op == operation and seconds > 0)
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=operation)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("bytes per rank")
    axis.set_ylabel("algorithm bandwidth (GB/s)")
    axis.grid(alpha=0.3)
    axis.legend()
    return _save(figure, path)
