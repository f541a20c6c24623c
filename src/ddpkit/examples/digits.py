"""The UCI handwritten digits (1797 8x8 images, CC BY 4.0), bundled with ddpkit."""

from __future__ import annotations

import gzip
import hashlib
from importlib import resources

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = ["DIGITS_SHA256", "digits_datasets", "load_digits"]

#: sha256 of the bundled ``digits.csv.gz`` (see ``examples/data/README.md`` for its licence).
DIGITS_SHA256 = "09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The digits as ``(images, labels)``.

    Returns:
        ``images``: float32 array of shape ``(1797, 64)``, pixel counts scaled to
        ``[0, 1]`` (row-major 8x8); ``labels``: int64 array of shape ``(1797,)``
        with classes 0..9.

    Raises:
        ValueError: the bundled file does not match its recorded sha256.
    """
    raw = resources.files("ddpkit.examples").joinpath("data/digits.csv.gz").read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DIGITS_SHA256:
        raise ValueError(f"bundled digits.csv.gz has sha256 {digest}, expected {DIGITS_SHA256}; reinstall ddpkit")
    table = np.loadtxt(gzip.decompress(raw).decode("ascii").splitlines(), delimiter=",", dtype=np.int64)
    return (table[:, :64] / 16.0).astype(np.float32), table[:, 64].copy()


def digits_datasets(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A reproducible train / validation split of the digits, as ``TensorDataset`` of (image, label).

    Args:
        val_fraction: share of the 1797 samples held out, in ``(0, 1)``; default 0.2 (360 samples).
        seed: seed of the permutation that splits them.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    images, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    n_val = round(len(labels) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return (
        TensorDataset(torch.from_numpy(images[train]), torch.from_numpy(labels[train])),
        TensorDataset(torch.from_numpy(images[val]), torch.from_numpy(labels[val])),
    )
