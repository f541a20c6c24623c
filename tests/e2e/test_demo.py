"""The main job: the bundled digits data and `ddpkit demo` training with 2 processes.

Here, the tests that start fresh processes; the others are in tests/unit/test_demo.py and tests/ranks/test_demo.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_ddpkit_demo_trains_on_two_processes_to_90_percent() -> None:
    """The README's main job, through the installed console script."""
    command = shutil.which("ddpkit", path=str(Path(sys.executable).parent))
    assert command is not None, "the ddpkit console script is not installed next to this Python"
    done = subprocess.run([command, "demo"], capture_output=True, text=True, timeout=170, check=False)
    assert done.returncode == 0, done.stderr
    line = (
        r"^epoch +(\d+)/10 +train loss [\d.]+ +validation loss [\d.]+ +validation accuracy [\d.]+ +"
        r"\d+ items/s +peak memory \d+(?:-\d+)? MiB/rank(?: \(most: rank [01]\))? +"
        r"load\+forward [\d.]+-[\d.]+ ms/batch \(slowest rank [01]\)$"
    )
    epochs = re.findall(line, done.stdout, re.MULTILINE)
    assert epochs == [str(e) for e in range(1, 11)], "rank 0, and only rank 0, prints each epoch once"
    summary = re.search(r"ddpkit demo: 2 processes \(gloo\), 10 epochs, .*validation accuracy ([\d.]+) "
                        r"\((\d+)/359\)", done.stdout)  # fmt: skip
    assert summary is not None, done.stdout
    assert float(summary.group(1)) >= 0.90
