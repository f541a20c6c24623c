"""The layers of ARCHITECTURE.md hold: every module is in the table, and no import points up.

Here, the tests that start fresh processes; the others are in tests/unit/test_architecture.py.
"""

from __future__ import annotations

import subprocess
import sys


def test_moved_modules_are_still_importable_at_their_old_paths() -> None:
    """The paths of earlier versions re-export what moved, and importing one does not replace a public name of
    the package: ``ddpkit.launch`` is the function, also after ``import ddpkit.launch`` in a fresh process."""
    code = (
        "import inspect, ddpkit\n"
        "import ddpkit.launch, ddpkit.train_loop, ddpkit.preemption, ddpkit.checkpoint, ddpkit.cli\n"
        "from ddpkit.launch import launch, run_script, scheduler_environment\n"
        "from ddpkit.train_loop import TrainLoop\n"
        "from ddpkit.preemption import Preempted, PreemptionHandler\n"
        "from ddpkit.checkpoint import load_checkpoint, save_checkpoint\n"
        "assert inspect.isfunction(ddpkit.launch) and ddpkit.launch is launch, ddpkit.launch\n"
        "assert ddpkit.TrainLoop is TrainLoop and ddpkit.run_script is run_script\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
