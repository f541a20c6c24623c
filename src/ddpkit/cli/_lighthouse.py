"""``ddpkit lighthouse``: torchft's lighthouse for fault-tolerant jobs on several nodes."""

from __future__ import annotations

import argparse
from typing import Any

from ddpkit.cli._common import fail, use_secret_file
from ddpkit.errors import PortTakenError, RendezvousFailedError

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit lighthouse``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
    lighthouse = commands.add_parser(
        "lighthouse",
        help="serve torchft's lighthouse for fault-tolerant jobs on several nodes",
        description=(
            "Serve torchft's lighthouse (the quorum server of `ddpkit run --fault-tolerance --nnodes N`) on one "
            "address of this machine until Ctrl-C, and the job's record (how far it got, whether it finished) on "
            "PORT + 1; the nodes' --rdzv-endpoint is HOST:PORT"
        ),
    )
    lighthouse.add_argument("--host", required=True, help="this machine's address that the nodes reach")
    lighthouse.add_argument("--port", type=int, default=29510, help="the port (default 29510)")
    lighthouse.add_argument(
        "--min-replicas", type=int, default=1, help="the fewest replica groups a step may commit with (default 1)"
    )
    lighthouse.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="a file holding the job secret, the nodes' own (instead of DDPKIT_JOB_SECRET): the job's record is "
        "signed with it",
    )
    lighthouse.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ddpkit.fault_tolerance._job import serve_until_interrupted

    failed = use_secret_file("lighthouse", args.secret_file)
    if failed is not None:
        return failed
    try:
        return serve_until_interrupted(args.host, args.port, args.min_replicas)
    except ValueError as error:
        return fail("lighthouse", error, status=2)
    except (ImportError, RendezvousFailedError, PortTakenError) as error:
        return fail("lighthouse", error)
