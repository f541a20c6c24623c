"""``ddpkit run --fault-tolerance``: this machine's replica groups, each under an elastic agent of its own.

This process serves torchft's lighthouse on loopback; every replica group is a ``ddpkit run -n 1`` of
its own, a child of this process with ``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` set. When a group's
worker dies, its agent starts it again (``--max-restarts``) and it rejoins the quorum, while the other
groups go on in their processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from ddpkit.fault_tolerance._lighthouse import serve_lighthouse
from ddpkit.fault_tolerance._settings import LIGHTHOUSE_VARIABLE, REPLICA_ID_VARIABLE

__all__ = ["run_replica_groups"]


def run_replica_groups(
    script: str, script_args: Sequence[str], *, groups: int, max_restarts: int, module: bool = False,
    min_replicas: int = 1,
) -> int:  # fmt: skip
    """Run ``groups`` replica groups of ``script`` on this machine, named ``group-0``, ``group-1``, ... (each
    a ``ddpkit run -n 1`` child started again up to ``max_restarts`` times), with the job's lighthouse on
    loopback in this process. Returns the first failed group's exit status, or 0 when all ended well.

    Raises:
        ValueError: ``groups`` below 1.
        ImportError: torchft is not installed (the message says how to install it).
    """
    if groups < 1:
        raise ValueError(f"--nproc-per-node {groups}: with --fault-tolerance it counts replica groups (>= 1)")
    with serve_lighthouse("127.0.0.1", min_replicas=min_replicas) as lighthouse:
        print(f"ddpkit run: torchft's lighthouse at {lighthouse.address}", file=sys.stderr, flush=True)
        children = [_start_group(script, script_args, f"group-{i}", lighthouse.address, max_restarts, module)
                    for i in range(groups)]  # fmt: skip
        return _wait(children)


def _start_group(
    script: str, script_args: Sequence[str], replica_id: str, lighthouse: str, max_restarts: int, module: bool
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "1", "--max-restarts", str(max_restarts)]
    command += ["-m"] if module else []
    env = {**os.environ, LIGHTHOUSE_VARIABLE: lighthouse, REPLICA_ID_VARIABLE: replica_id}
    return subprocess.Popen([*command, script, *script_args], env=env)


def _wait(children: list[subprocess.Popen[bytes]]) -> int:
    """Wait for every group; Ctrl-C or SIGTERM here stops them all. The first failed group's status."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        statuses = [child.wait() for child in children]
        return next((status for status in statuses if status != 0), 0)
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
