"""``ddpkit run``: a torchrun-style script on N processes a node, or fault-tolerant replica groups."""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from ddpkit.cli._common import add_job_arguments, fail, use_secret_file
from ddpkit.cli._doctor import handle as doctor
from ddpkit.environments import ClusterEnvironment
from ddpkit.errors import ClusterEnvironmentError, PortTakenError, RendezvousFailedError, WorkerFailedError
from ddpkit.fault_tolerance._job import job_shape_problems, run_node_group, run_replica_groups, script_groups
from ddpkit.hangs._watchdog import hang_timeout
from ddpkit.jobs._agent_log import VERBOSE_VARIABLE
from ddpkit.jobs.launch import check_target, run_script, scheduler_environment

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit run``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
    run = commands.add_parser(
        "run",
        help="run a torchrun-style script on N processes",
        description=(
            "Run SCRIPT on N processes per node with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR, MASTER_PORT) set. Single node: loopback and a free port. Restarts start every "
            "worker afresh with its own store."
        ),
    )
    add_job_arguments(run)
    run.add_argument("--max-restarts", type=int, default=0, help="restarts of all workers after a failure (default 0)")
    run.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a rank may wait in one collective before the job is reported as hung and stopped "
        "(default 300, or DDPKIT_HANG_TIMEOUT; 0: never)",
    )
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m")
    run.add_argument(
        "--verbose",
        action="store_true",
        help="also show torch's launcher log and every rank's traceback on stderr (default: in a log file "
        "that a failure names)",
    )
    run.add_argument(
        "--fault-tolerance",
        action="store_true",
        help="per-step fault tolerance on torchft (pip install torchft==0.2.0, ddpkit's ft extra). On one machine: a "
        "lighthouse here on loopback and the -n processes replica groups of --group-size ranks, each under an agent "
        "of its own, named group-0, group-1, ... (REPLICA_GROUP_ID), started again up to --max-restarts times when "
        "one of its ranks dies while the others go on. On several machines (--nnodes N --rdzv-endpoint HOST:PORT "
        "--secret-file F, the same command on every node): each node one replica group, the node at HOST serving "
        "the lighthouse. The script trains with TrainLoop(fault_tolerance='torchft')",
    )
    run.add_argument(
        "--group-size",
        type=int,
        default=1,
        metavar="M",
        help="with --fault-tolerance: ranks per replica group (default 1); -n must be a multiple of it",
    )
    run.add_argument(
        "--replica-id",
        default=None,
        metavar="NAME",
        help="with --fault-tolerance --nnodes N: this node's replica group's name (default: the host name)",
    )
    run.add_argument("--doctor", action="store_true", help="run `ddpkit doctor` on these processes instead of SCRIPT")
    run.add_argument("script", metavar="SCRIPT", nargs="?", help="the training script (or module, with -m)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments of the script")
    run.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    failed = use_secret_file("run", args.secret_file)
    if failed is not None:
        return failed
    if args.doctor:
        args.peer_timeout = 10.0
        return doctor(args)
    if args.script is None:
        return fail("run", ValueError("SCRIPT is required (or --doctor)"), status=2)
    try:
        check_target(args.script, args.module)  # once, here: not a traceback from every worker
    except FileNotFoundError as error:
        return fail("run", error, status=2)
    if args.verbose:
        os.environ[VERBOSE_VARIABLE] = "1"
    if args.fault_tolerance:
        return _run_replica_groups(args)
    if args.group_size != 1:
        return fail("run", f"--group-size {args.group_size} is for --fault-tolerance's replica groups", status=2)
    options = {
        "nprocs": args.nprocs,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "rdzv_endpoint": args.rdzv_endpoint,
        "run_id": args.rdzv_id,
        "max_restarts": args.max_restarts,
        "module": args.module,
        "join_timeout": args.join_timeout,
        "timeout": args.timeout,
        "rdzv_conf": args.rdzv_conf,
    }
    if scheduler_environment() is not None:
        # srun, mpirun: the script runs in this process, and its own errors (a ValueError included)
        # end it as they would end `python script.py`: with their traceback and exit status 1.
        try:
            hang_timeout(args.timeout)
        except ValueError as error:
            return fail("run", error, status=2)
        try:
            run_script(args.script, args.script_args, **options)
        except (RendezvousFailedError, ClusterEnvironmentError) as error:  # before the script starts
            return fail("run", error)
        return 0
    try:
        run_script(args.script, args.script_args, **options)
    except (WorkerFailedError, RendezvousFailedError, PortTakenError, ClusterEnvironmentError) as error:
        return fail("run", error)
    except ValueError as error:
        return fail("run", error, status=2)
    except SignalException as error:  # Ctrl-C, or SIGTERM (scancel, a walltime): torch's agent stopped the workers
        name = signal.Signals(error.sigval).name
        return fail("run", f"stopped by {name}: the workers were stopped", status=128 + int(error.sigval))
    return 0


def _run_replica_groups(args: argparse.Namespace) -> int:
    # The groups' own addresses come from --rdzv-endpoint: mpirun's tasks on several nodes need no MASTER_ADDR.
    host = (args.rdzv_endpoint or "").rpartition(":")[0]
    try:
        scheduler = scheduler_environment({"MASTER_ADDR": host, **os.environ} if host else None)
    except ClusterEnvironmentError as error:
        return fail("run", error)
    if scheduler is not None and (scheduler.name not in ("slurm", "mpi") or args.nnodes == "1"
                                  or not _alone_on_its_node(scheduler)):  # fmt: skip
        return fail(
            "run",
            "--fault-tolerance starts the replica groups itself: under srun or mpirun, run it as one task a node "
            "with --nnodes (srun --ntasks-per-node 1 ddpkit run --fault-tolerance --nnodes $SLURM_NNODES ..., "
            "mpirun --map-by ppr:1:node ...), not as one of several tasks of "
            f"{scheduler.name} on a node (see the documentation's fault-tolerance page, docs/fault-tolerance.md)",
            status=2,
        )
    problems = job_shape_problems(args.nnodes, args.rdzv_endpoint, args.group_size, flags=True)
    if problems:
        return fail("run", "--fault-tolerance cannot take " + "; ".join(problems), status=2)
    start = script_groups(args.script, args.script_args, max_restarts=args.max_restarts, module=args.module)
    if args.nnodes != "1":
        try:
            return run_node_group(
                start, nnodes=int(args.nnodes), endpoint=args.rdzv_endpoint, nprocs=args.nprocs,
                replica_id=args.replica_id or os.environ.get("SLURMD_NODENAME"),
            )  # fmt: skip
        except ValueError as error:
            return fail("run", error, status=2)
        except (ImportError, RendezvousFailedError, PortTakenError) as error:
            return fail("run", error)
    if args.replica_id is not None:
        return fail("run", "--replica-id names a node's group: it goes with --fault-tolerance --nnodes N", status=2)
    processes, size = 1 if args.nprocs is None else args.nprocs, args.group_size
    if size < 1 or processes % size:
        return fail(
            "run",
            f"--group-size {size} with -n {processes}: the -n processes make replica groups of --group-size ranks "
            "each, so -n must be a multiple of --group-size, which is at least 1 (-n 4 --group-size 2: two groups "
            "of two ranks)",
            status=2,
        )
    try:
        statuses = run_replica_groups(start, groups=processes // size, group_size=size)
        return next((status for status in statuses if status != 0), 0)
    except ValueError as error:
        return fail("run", error, status=2)
    except ImportError as error:
        return fail("run", error)


def _alone_on_its_node(scheduler: ClusterEnvironment) -> bool:
    """Whether this task of ``srun`` or ``mpirun`` is its node's only one (the first, where the count is
    unknown)."""
    count = scheduler.local_world_size()
    return count == 1 if count is not None else scheduler.local_rank() == 0
