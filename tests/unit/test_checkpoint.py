"""Atomic checkpoints: a write interrupted at any point leaves the previous checkpoint loadable.

Here, the tests that need no process; the others are in tests/e2e/test_checkpoint.py.
"""

from __future__ import annotations

import io
import os
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ddpkit import checkpoint
from ddpkit.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from ddpkit.training import TrainState
from tests.support.checkpoint import _leftovers, _state


def _assert_whole(path: Path, step: int) -> None:
    loaded = load_checkpoint(path)
    assert loaded["step"] == step
    assert torch.equal(loaded["weights"], torch.full((5000,), float(step)))
    assert loaded["nested"] == {"names": ["a", "b"]}


def _serialised_size() -> int:
    buffer = io.BytesIO()
    torch.save(_state(2), buffer)
    return len(buffer.getvalue())


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999])
def test_a_write_cut_off_after_any_number_of_bytes_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fraction: float
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(_state(1), path)
    cut = int(_serialised_size() * fraction)
    real_save = torch.save

    def partial_save(obj: object, handle: io.BufferedWriter) -> None:
        buffer = io.BytesIO()
        real_save(obj, buffer)
        handle.write(buffer.getvalue()[:cut])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", partial_save)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(_state(2), path)
    _assert_whole(path, 1)
    assert _leftovers(tmp_path) == [], "the temporary file is removed"


@pytest.mark.parametrize("stage", ["fsync", "replace"])
def test_a_failing_fsync_or_rename_leaves_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint(_state(1), path)

    def fail(*args: object) -> None:
        raise OSError(5, f"Input/output error in {stage}")

    monkeypatch.setattr(checkpoint.os, stage, fail)
    with pytest.raises(OSError, match=stage):
        save_checkpoint(_state(2), path)
    monkeypatch.undo()
    _assert_whole(path, 1)
    assert _leftovers(tmp_path) == []
    save_checkpoint(_state(3), path)
    _assert_whole(path, 3)


def test_two_writers_at_once_both_succeed_and_leave_a_whole_file(tmp_path: Path) -> None:
    """Two writers that each believe they write the checkpoint (two fault-tolerant groups that were each
    participant 0 of a quorum), 20 times each at once: neither removes the other's temporary file (the first
    to finish did, and the other's rename failed), and the file is a whole one of theirs."""
    path = tmp_path / "last.pt"
    errors: list[BaseException] = []

    def write(first: int) -> None:
        try:
            for step in range(first, first + 40, 2):
                save_checkpoint({"step": step, "weights": torch.full((500_000,), float(step))}, path)
        except BaseException as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(first,)) for first in (1, 2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert errors == []
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["weights"], torch.full((500_000,), float(loaded["step"])))
    assert _leftovers(tmp_path) == []


class _Custom:
    pass


def test_loading_never_unpickles_arbitrary_objects(tmp_path: Path) -> None:
    save_checkpoint({"object": _Custom()}, tmp_path / "bad.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        load_checkpoint(tmp_path / "bad.pt")


def test_rng_state_round_trips_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    np.random.standard_normal()  # a cached Gaussian in numpy's state
    save_checkpoint({"rng": rng_state()}, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.standard_normal(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    set_rng_state(load_checkpoint(tmp_path / "rng.pt")["rng"])
    again = (torch.rand(3), np.random.standard_normal(3), random.random())
    assert torch.equal(again[0], expected[0])
    assert np.array_equal(again[1], expected[1])
    assert again[2] == expected[2]
    assert os.listdir(tmp_path) == ["rng.pt"]


def _train_state(version: int) -> dict[str, Any]:
    return {
        "version": version,
        "model": {"w": torch.ones(2)},
        "optimizer": {},
        "epoch": 1,
        "position": 0,
        "epoch_sums": torch.zeros(2, dtype=torch.float64),
        "global_step": 3,
        "seed": 0,
        "world_size": 2,
        "rng": [rng_state()],
    }


def test_every_earlier_train_state_version_is_read_and_a_later_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = TrainState.VERSION
    monkeypatch.setattr(TrainState, "VERSION", current + 1)  # the next format: the current one still reads
    for version in range(2, current + 2):
        save_checkpoint(_train_state(version), tmp_path / f"v{version}.pt")
        assert TrainState.load(tmp_path / f"v{version}.pt").global_step == 3
    save_checkpoint(_train_state(current + 2), tmp_path / "later.pt")
    with pytest.raises(
        ValueError, match=rf"of version {current + 2}; this ddpkit reads .* versions 1 to {current + 1}"
    ):
        TrainState.load(tmp_path / "later.pt")
