"""Atomic checkpoints: a write interrupted at any point leaves the previous checkpoint loadable.

Here, the tests that start fresh processes; the others are in tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint import STALE_AFTER_S, load_checkpoint, save_checkpoint
from tests.support.checkpoint import _leftovers, _state

_WRITER = """
import sys, torch
from ddpkit.checkpoint import save_checkpoint
step = 0
while True:
    step += 1
    save_checkpoint({"step": step, "weights": torch.full((2_000_000,), float(step))}, sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_a_writer_killed_at_random_moments_always_leaves_a_whole_checkpoint(tmp_path: Path) -> None:
    """SIGKILL, the real interruption: no exception handler runs, the temporary file stays behind."""
    path = tmp_path / "last.pt"
    chooser = random.Random(0)
    steps = []
    for _ in range(4):
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)])
        deadline = time.monotonic() + 60
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(chooser.uniform(0.05, 0.5))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        loaded = load_checkpoint(path)
        assert torch.equal(loaded["weights"], torch.full((2_000_000,), float(loaded["step"])))
        steps.append(loaded["step"])
    assert all(step >= 1 for step in steps)
    left = _leftovers(tmp_path)
    save_checkpoint(_state(9), path)
    assert _leftovers(tmp_path) == left, "a fresh temporary file may be another writer's: kept"
    for leftover in left:  # as if the killed writers had left them long ago
        os.utime(tmp_path / leftover, (time.time() - STALE_AFTER_S - 1,) * 2)
    save_checkpoint(_state(10), path)
    assert _leftovers(tmp_path) == [], "a successful write removes what killed writers left"
