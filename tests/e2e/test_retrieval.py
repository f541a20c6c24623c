"""The retrieval demo: P x K batches, triplets mined over all ranks with their gradient, exact precision@1.

Here, the tests that start fresh processes; the others are in tests/unit/test_retrieval.py and
tests/ranks/test_retrieval.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

B, D = 12, 5  # per-rank batch and embedding size


@pytest.mark.timeout(180)
def test_ddpkit_demo_retrieval_runs_on_two_processes() -> None:
    command = shutil.which("ddpkit", path=str(Path(sys.executable).parent))
    assert command is not None
    done = subprocess.run(
        [command, "demo", "--task", "retrieval", "--epochs", "3", "--no-progress"],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    epochs = re.findall(r"^epoch +(\d)/3 +train loss [\d.]+ +validation precision_at_1 [\d.]+ +\d+ items/s +"
                        r"peak memory \d+(?:-\d+)? MiB/rank(?: \(most: rank [01]\))? +load\+forward "
                        r"[\d.]+-[\d.]+ ms/batch \(slowest rank [01]\)$", done.stdout, re.M)  # fmt: skip
    assert epochs == ["1", "2", "3"]
    summary = re.search(r"2 processes \(gloo\), 3 epochs, .* precision@1 ([\d.]+) \(untrained ([\d.]+)\)", done.stdout)
    assert summary is not None, done.stdout
    assert float(summary.group(1)) > float(summary.group(2))
