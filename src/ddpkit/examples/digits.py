"""The UCI handwritten digits (1797 8x8 images, CC BY 4.0), bundled with ddpkit."""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from functools import cache
from importlib import resources
from typing import Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset, TensorDataset

__all__ = ["DIGITS_SHA256", "DigitsStream", "digits_datasets", "load_digits"]

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
    table = np.loadtxt(_csv_rows(), delimiter=",", dtype=np.int64)
    return (table[:, :64] / 16.0).astype(np.float32), table[:, 64].copy()


@cache
def _csv_rows() -> tuple[str, ...]:
    """The bundled CSV's rows (checked against its sha256)."""
    raw = resources.files("ddpkit.examples").joinpath("data/digits.csv.gz").read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != DIGITS_SHA256:
        raise ValueError(f"bundled digits.csv.gz has sha256 {digest}, expected {DIGITS_SHA256}; reinstall ddpkit")
    return tuple(gzip.decompress(raw).decode("ascii").splitlines())


def _split(count: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train rows, validation rows)``: a seeded permutation of ``range(count)`` cut in two."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    order = np.random.default_rng(seed).permutation(count)
    n_val = round(count * val_fraction)
    return order[n_val:], order[:n_val]


class DigitsStream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits as a stream: a generator that parses the CSV's rows one by one, in shards of consecutive rows.

    The rows are those of :func:`digits_datasets`'s split, in the same order, so
    the stream holds the same ``(image (64,) float32, label int64)`` samples.

    Args:
        split: ``"train"`` (default) or ``"validation"``.
        val_fraction, seed: as for :func:`digits_datasets`.
        num_shards: row ranges the stream is cut into (default 8): ``num_shards``
            and :meth:`iter_shard` let ``ShardedStream`` split it by shard.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)``, ``num_shards < 1`` or an unknown ``split``.
    """

    def __init__(
        self, split: Literal["train", "validation"] = "train", val_fraction: float = 0.2, seed: int = 0,
        num_shards: int = 8,
    ) -> None:  # fmt: skip
        if split not in ("train", "validation") or num_shards < 1:
            raise ValueError(f"split={split!r} must be 'train' or 'validation', and num_shards={num_shards} >= 1")
        train, validation = _split(len(_csv_rows()), val_fraction, seed)
        self.rows = train if split == "train" else validation
        self.num_shards = num_shards

    def iter_shard(self, index: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The samples of shard ``index`` (a range of the stream's rows), parsed as they are read."""
        lines = _csv_rows()
        for row in np.array_split(self.rows, self.num_shards)[index]:
            values = np.array(lines[row].split(","), dtype=np.int64)
            yield torch.from_numpy((values[:64] / 16.0).astype(np.float32)), torch.tensor(values[64])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(self.num_shards):
            yield from self.iter_shard(index)


def digits_datasets(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """A reproducible train / validation split of the digits, as ``TensorDataset`` of (image, label).

    Args:
        val_fraction: share of the 1797 samples held out, in ``(0, 1)``; default 0.2 (360 samples).
        seed: seed of the permutation that splits them.

    Raises:
        ValueError: ``val_fraction`` outside ``(0, 1)``.
    """
    images, labels = load_digits()
    train, val = _split(len(labels), val_fraction, seed)
    return (
        TensorDataset(torch.from_numpy(images[train]), torch.from_numpy(labels[train])),
        TensorDataset(torch.from_numpy(images[val]), torch.from_numpy(labels[val])),
    )
