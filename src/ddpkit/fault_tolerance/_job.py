"""``ddpkit run --fault-tolerance``: this machine's replica groups, each under an elastic agent of its own.

This process serves torchft's lighthouse on loopback; every replica group is a ``ddpkit run -n M`` of its
own (``M``: the group's ranks, 1 by default), a child of this process with ``TORCHFT_LIGHTHOUSE`` and
``REPLICA_GROUP_ID`` set, and the job's secret in ``DDPKIT_JOB_SECRET`` (the one this process was given, else
one drawn for this job): every quorum's members prove they hold it. When a rank of a group dies, its agent
starts the group again (``--max-restarts``) and it rejoins the quorum, while the other groups go on in their
processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from ddpkit._secret import SECRET_VARIABLE, job_secret, new_job_secret
from ddpkit.fault_tolerance._lighthouse import serve_lighthouse
from ddpkit.fault_tolerance._settings import GROUPS_VARIABLE, LIGHTHOUSE_VARIABLE, REPLICA_ID_VARIABLE

__all__ = ["run_replica_groups"]


def run_replica_groups(
    script: str, script_args: Sequence[str], *, groups: int, max_restarts: int, module: bool = False,
    lighthouse: str | None = None, min_replicas: int = 1, group_size: int = 1,
) -> list[int]:  # fmt: skip
    """Run ``groups`` replica groups of ``script`` on this machine, named ``group-0``, ``group-1``, ... (each
    a ``ddpkit run -n group_size`` child, its ranks restarted together up to ``max_restarts`` times), with the
    job's lighthouse on loopback in this process (or at ``lighthouse``, one that runs already). Every group gets
    the job secret in its environment: this process's (``DDPKIT_JOB_SECRET`` or ``--secret-file``), else one
    drawn for this job (32 random bytes), and their number (``DDPKIT_REPLICA_GROUPS``: the job's first step
    waits for them all). Returns each group's exit status (Ctrl-C or SIGTERM stops them all: 130 each).

    Raises:
        ValueError: ``groups`` or ``group_size`` below 1.
        ImportError: torchft is not installed (the message says how to install it).
    """
    if groups < 1 or group_size < 1:
        raise ValueError(f"{groups} replica groups of {group_size} ranks: start at least one group of one rank")
    if lighthouse is not None:
        return _run_groups(script, script_args, groups, group_size, lighthouse, max_restarts, module)
    with serve_lighthouse("127.0.0.1", min_replicas=min_replicas) as served:
        print(f"ddpkit: torchft's lighthouse at {served.address}", file=sys.stderr, flush=True)
        return _run_groups(script, script_args, groups, group_size, served.address, max_restarts, module)


def _run_groups(
    script: str, script_args: Sequence[str], groups: int, size: int, lighthouse: str, max_restarts: int,
    module: bool,
) -> list[int]:  # fmt: skip
    secret = (job_secret() or new_job_secret()).decode()  # one for the whole job
    children = [
        _start_group(script, script_args, f"group-{i}", size, lighthouse, max_restarts, module, secret, groups)
        for i in range(groups)
    ]
    return _wait(children)


def _start_group(
    script: str,
    script_args: Sequence[str],
    replica_id: str,
    size: int,
    lighthouse: str,
    max_restarts: int,
    module: bool,
    secret: str,
    groups: int,
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "ddpkit", "run", "-n", str(size), "--max-restarts", str(max_restarts)]
    command += ["-m"] if module else []
    env = {**os.environ, LIGHTHOUSE_VARIABLE: lighthouse, REPLICA_ID_VARIABLE: replica_id, SECRET_VARIABLE: secret,
           GROUPS_VARIABLE: str(groups)}  # fmt: skip
    return subprocess.Popen([*command, script, *script_args], env=env)


def _wait(children: list[subprocess.Popen[bytes]]) -> list[int]:
    """Wait for every group; Ctrl-C or SIGTERM here stops them all. Their exit statuses."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return [child.wait() for child in children]
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
        return [130] * len(children)
    finally:
        signal.signal(signal.SIGTERM, previous)
