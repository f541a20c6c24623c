"""What several test modules share: cli."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def ddpkit(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Run ``python -m ddpkit ARGS`` in its own session; on timeout kill the whole session, workers included."""
    command = [sys.executable, "-m", "ddpkit", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
