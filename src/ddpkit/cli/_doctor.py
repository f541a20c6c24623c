"""``ddpkit doctor``: every rank reaches every other; all_reduce and all_gather timed."""

from __future__ import annotations

import argparse
from typing import Any

from ddpkit.cli._common import add_job_arguments, fail, use_secret_file
from ddpkit.errors import PortTakenError, RendezvousFailedError, WorkerFailedError
from ddpkit.jobs.launch import launch

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit doctor``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
    doctor = commands.add_parser(
        "doctor",
        help="check that every rank reaches every other; time all_reduce and all_gather",
        description=(
            "Start N processes per node as `ddpkit run` would (or use the tasks of srun / mpirun), check that "
            "every rank exchanges a message with every other rank, then print all_reduce and all_gather latency "
            "(small messages) and bandwidth (large messages). Exits 1 with a diagnosis when a rank is "
            "unreachable, a node does not join, or the rendezvous port is taken."
        ),
    )
    add_job_arguments(doctor)
    doctor.add_argument(
        "--peer-timeout", type=float, default=10.0, help="seconds to wait for each peer's message (default 10)"
    )
    doctor.add_argument(
        "--plot", default=None, metavar="PATH", help="also write a PNG of bandwidth against message size here"
    )
    doctor.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from ddpkit.doctor import check_ranks

    failed = use_secret_file("doctor", args.secret_file)
    if failed is not None:
        return failed
    try:
        results = launch(
            check_ranks,
            nprocs=2 if args.nprocs is None else args.nprocs,
            nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint,
            run_id=args.rdzv_id,
            join_timeout=60.0 if args.join_timeout is None else args.join_timeout,
            rdzv_conf=args.rdzv_conf,
            timeout=max(30.0, 3 * args.peer_timeout),
            peer_timeout=args.peer_timeout,
        )
    except WorkerFailedError as error:
        return fail("doctor", f"a rank failed before the checks could finish. {error}")
    except (RendezvousFailedError, PortTakenError) as error:
        return fail("doctor", error)
    except ValueError as error:
        return fail("doctor", error, status=2)
    report = results.get(0)
    if report is None:
        ranks = ", ".join(map(str, sorted(results)))
        print(f"ddpkit doctor: ranks {ranks} of this node took part; rank 0's node prints the report")
        return 0
    print(report.format())
    if getattr(args, "plot", None) and report.measurements:
        from ddpkit.plotting import plot_bandwidth

        rows = [(m.operation, m.nbytes, m.seconds) for m in report.measurements]
        print(f"bandwidth plot: {plot_bandwidth(rows, args.plot)}")
    return 0 if report.ok else 1
