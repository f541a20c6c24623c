"""What the ``ddpkit`` commands share: one way to fail, the job secret file, and where a job's processes run."""

from __future__ import annotations

import argparse
import sys

from ddpkit._trust.secret import read_secret_file, use_job_secret
from ddpkit.errors import JobSecretError

__all__ = ["add_job_arguments", "fail", "use_secret_file"]


def fail(command: str, error: BaseException | str, status: int = 1) -> int:
    """Say ``ddpkit COMMAND: error`` (and its notes) on stderr; ``status``."""
    notes = getattr(error, "__notes__", [])  # e.g. where torch's launcher log is
    print("\n".join([f"ddpkit {command}: {error}", *notes]), file=sys.stderr)
    return status


def use_secret_file(command: str, path: str | None) -> int | None:
    """Read ``--secret-file`` into this process's rendezvous; an exit status if it cannot be used."""
    if path is None:
        return None
    try:
        use_job_secret(read_secret_file(path), f"--secret-file {path}")
    except JobSecretError as error:
        return fail(command, error, status=2)
    except OSError as error:
        return fail(command, f"--secret-file {path}: {error}", status=2)
    return None


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments that say where a job's processes run (``run`` and ``doctor``)."""
    parser.add_argument(
        "-n",
        "--nproc-per-node",
        "--nprocs",
        dest="nprocs",
        type=int,
        default=None,
        help="processes per node (default: CUDA devices, or 1; doctor: 2)",
    )
    parser.add_argument(
        "--nnodes",
        default="1",
        metavar="N|MIN:MAX",
        help="number of nodes (default 1); MIN:MAX for an elastic job that goes on while MIN nodes are up",
    )
    parser.add_argument(
        "--node-rank", type=int, default=0, help="accepted as torchrun does; the rendezvous numbers the nodes"
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="rendezvous endpoint, the same on every node (default 127.0.0.1 and a free port)",
    )
    parser.add_argument("--rdzv-id", default=None, help="rendezvous id shared by the nodes of one job")
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds for all nodes to join the rendezvous (default 600; doctor: 60)",
    )
    parser.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="more rendezvous settings, as torchrun's (e.g. last_call_timeout=5,keep_alive_interval=2)",
    )
    parser.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="a file holding the job secret, the same on every node: the rendezvous is signed with it and every "
        "rank proves that it holds it (instead of DDPKIT_JOB_SECRET; see docs/security.md)",
    )
