"""The ``ddpkit`` command: ``run``, ``doctor``, ``lighthouse``, ``secret``, ``env`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException

from ddpkit import __version__
from ddpkit._secret import read_secret_file, use_job_secret, write_secret_file
from ddpkit.environments import ClusterEnvironment, detect_environment
from ddpkit.errors import (
    ClusterEnvironmentError,
    JobSecretError,
    PortTakenError,
    RendezvousFailedError,
    WorkerFailedError,
)
from ddpkit.fault_tolerance._job import run_replica_groups
from ddpkit.hangs._watchdog import hang_timeout
from ddpkit.jobs._agent_log import VERBOSE_VARIABLE
from ddpkit.jobs.launch import check_target, launch, run_script, scheduler_environment

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ddpkit`` and its sub-commands."""
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Correct PyTorch DDP training, from one CPU laptop to a multi-node cluster.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="run a torchrun-style script on N processes",
        description=(
            "Run SCRIPT on N processes per node with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR, MASTER_PORT) set. Single node: loopback and a free port. Restarts start every "
            "worker afresh with its own store."
        ),
    )
    _add_job_arguments(run)
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
    run.set_defaults(handler=_run)

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
    _add_job_arguments(doctor)
    doctor.add_argument(
        "--peer-timeout", type=float, default=10.0, help="seconds to wait for each peer's message (default 10)"
    )
    doctor.add_argument(
        "--plot", default=None, metavar="PATH", help="also write a PNG of bandwidth against message size here"
    )
    doctor.set_defaults(handler=_doctor)

    lighthouse = commands.add_parser(
        "lighthouse",
        help="serve torchft's lighthouse for fault-tolerant jobs on several nodes",
        description=(
            "Serve torchft's lighthouse (the quorum server of `ddpkit run --fault-tolerance --nnodes N`) on one "
            "address of this machine until Ctrl-C; the nodes' --rdzv-endpoint is HOST:PORT"
        ),
    )
    lighthouse.add_argument("--host", required=True, help="this machine's address that the nodes reach")
    lighthouse.add_argument("--port", type=int, default=29510, help="the port (default 29510)")
    lighthouse.add_argument(
        "--min-replicas", type=int, default=1, help="the fewest replica groups a step may commit with (default 1)"
    )
    lighthouse.set_defaults(handler=_lighthouse)

    secret = commands.add_parser(
        "secret",
        help="make a job secret file (256 random bits, readable by you alone)",
        description="Create PATH holding a new job secret: 64 random hex digits, mode 0600. Give it to every node "
        "of a job with --secret-file PATH (keep it in a directory every node mounts, e.g. your home). An existing "
        "file is never overwritten.",
    )
    secret.add_argument("path", metavar="PATH", help="the file to create")
    secret.set_defaults(handler=_secret)

    env = commands.add_parser("env", help="print the detected cluster environment as JSON")
    env.set_defaults(handler=_env)

    demo = commands.add_parser(
        "demo",
        help="train on the digits with DDP on CPU processes (the main job)",
        description="Train on the bundled UCI digits data with DistributedDataParallel, through ddpkit.TrainLoop: "
        "a classifier (default), or an embedding for retrieval (metric learning with P x K batches, triplets "
        "mined across ranks, precision@1).",
    )
    demo.add_argument("--task", choices=("classification", "retrieval"), default="classification", help="what to train")
    demo.add_argument("--nprocs", type=int, default=2, help="CPU processes (default 2)")
    demo.add_argument("--epochs", type=int, default=10, help="epochs (default 10)")
    demo.add_argument(
        "--batch-size",
        type=int,
        default=32,
        help="samples per step on each process (default 32); retrieval: P classes x 4 samples, a multiple of 4",
    )
    demo.add_argument("--lr", type=float, default=None, help="SGD learning rate (default 0.1), momentum 0.9")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument(
        "--lr-schedule", choices=("none", "cosine"), default="none",
        help="learning rate from --lr down to 0 along a cosine over the epochs (classification; default none)",
    )  # fmt: skip
    demo.add_argument(
        "--precision", choices=("32", "bf16-mixed", "16-mixed"), default="32",
        help="mixed precision: autocast to bfloat16, or float16 with a gradient scaler (classification; default 32)",
    )  # fmt: skip
    demo.add_argument(
        "--clip", type=float, default=None, metavar="NORM",
        help="clip the gradients' total norm to NORM at each optimizer step (classification)",
    )  # fmt: skip
    demo.add_argument(
        "--logdir",
        default=None,
        metavar="DIR",
        help="write TensorBoard logs, metrics.csv and history.png (the curves) here (classification)",
    )
    demo.set_defaults(handler=_demo)
    return parser


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status


def _fail(command: str, error: BaseException | str, status: int = 1) -> int:
    notes = getattr(error, "__notes__", [])  # e.g. where torch's launcher log is
    print("\n".join([f"ddpkit {command}: {error}", *notes]), file=sys.stderr)
    return status


def _use_secret_file(command: str, path: str | None) -> int | None:
    """Read ``--secret-file`` into this process's rendezvous; an exit status if it cannot be used."""
    if path is None:
        return None
    try:
        use_job_secret(read_secret_file(path), f"--secret-file {path}")
    except JobSecretError as error:
        return _fail(command, error, status=2)
    except OSError as error:
        return _fail(command, f"--secret-file {path}: {error}", status=2)
    return None


def _secret(args: argparse.Namespace) -> int:
    try:
        write_secret_file(args.path)
    except FileExistsError:
        return _fail("secret", f"{args.path} exists; a job may be using it, so it is left as it is", status=2)
    except OSError as error:
        return _fail("secret", error, status=2)
    print(f"ddpkit secret: wrote a new job secret (256 random bits, readable by you alone) to {args.path}; "
          f"give it to every node: --secret-file {args.path}")  # fmt: skip
    return 0


def _run(args: argparse.Namespace) -> int:
    failed = _use_secret_file("run", args.secret_file)
    if failed is not None:
        return failed
    if args.doctor:
        args.peer_timeout = 10.0
        return _doctor(args)
    if args.script is None:
        return _fail("run", ValueError("SCRIPT is required (or --doctor)"), status=2)
    try:
        check_target(args.script, args.module)  # once, here: not a traceback from every worker
    except FileNotFoundError as error:
        return _fail("run", error, status=2)
    if args.verbose:
        os.environ[VERBOSE_VARIABLE] = "1"
    if args.fault_tolerance:
        return _run_replica_groups(args)
    if args.group_size != 1:
        return _fail("run", f"--group-size {args.group_size} is for --fault-tolerance's replica groups", status=2)
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
            return _fail("run", error, status=2)
        try:
            run_script(args.script, args.script_args, **options)
        except (RendezvousFailedError, ClusterEnvironmentError) as error:  # before the script starts
            return _fail("run", error)
        return 0
    try:
        run_script(args.script, args.script_args, **options)
    except (WorkerFailedError, RendezvousFailedError, PortTakenError, ClusterEnvironmentError) as error:
        return _fail("run", error)
    except ValueError as error:
        return _fail("run", error, status=2)
    except SignalException as error:  # Ctrl-C, or SIGTERM (scancel, a walltime): torch's agent stopped the workers
        name = signal.Signals(error.sigval).name
        return _fail("run", f"stopped by {name}: the workers were stopped", status=128 + int(error.sigval))
    return 0


def _run_replica_groups(args: argparse.Namespace) -> int:
    # The groups' own addresses come from --rdzv-endpoint: mpirun's tasks on several nodes need no MASTER_ADDR.
    host = (args.rdzv_endpoint or "").rpartition(":")[0]
    try:
        scheduler = scheduler_environment({"MASTER_ADDR": host, **os.environ} if host else None)
    except ClusterEnvironmentError as error:
        return _fail("run", error)
    if scheduler is not None and (scheduler.name not in ("slurm", "mpi") or args.nnodes == "1"
                                  or not _alone_on_its_node(scheduler)):  # fmt: skip
        return _fail(
            "run",
            "--fault-tolerance starts the replica groups itself: under srun or mpirun, run it as one task a node "
            "with --nnodes (srun --ntasks-per-node 1 ddpkit run --fault-tolerance --nnodes $SLURM_NNODES ..., "
            "mpirun --map-by ppr:1:node ...), not as one of several tasks of "
            f"{scheduler.name} on a node (see the documentation's fault-tolerance page, docs/fault-tolerance.md)",
            status=2,
        )
    if args.nnodes != "1":
        return _run_node_group(args)
    if args.replica_id is not None:
        return _fail("run", "--replica-id names a node's group: it goes with --fault-tolerance --nnodes N", status=2)
    processes, size = 1 if args.nprocs is None else args.nprocs, args.group_size
    if size < 1 or processes % size:
        return _fail(
            "run",
            f"--group-size {size} with -n {processes}: the -n processes make replica groups of --group-size ranks "
            "each, so -n must be a multiple of --group-size, which is at least 1 (-n 4 --group-size 2: two groups "
            "of two ranks)",
            status=2,
        )
    try:
        statuses = run_replica_groups(
            args.script, args.script_args, groups=processes // size, group_size=size,
            max_restarts=args.max_restarts, module=args.module,
        )  # fmt: skip
        return next((status for status in statuses if status != 0), 0)
    except ValueError as error:
        return _fail("run", error, status=2)
    except ImportError as error:
        return _fail("run", error)


def _alone_on_its_node(scheduler: ClusterEnvironment) -> bool:
    """Whether this task of ``srun`` or ``mpirun`` is its node's only one (the first, where the count is
    unknown)."""
    count = scheduler.local_world_size()
    return count == 1 if count is not None else scheduler.local_rank() == 0


def _run_node_group(args: argparse.Namespace) -> int:
    """``ddpkit run --fault-tolerance --nnodes N``: this node's replica group."""
    from ddpkit.fault_tolerance._job import run_node_group

    problems = [
        *([f"--nnodes {args.nnodes}: one replica group a node, a whole number of nodes (fault tolerance goes on "
           "with the groups left, so MIN:MAX has no use here)"] if not args.nnodes.isdigit() else []),
        *(["--rdzv-endpoint HOST:PORT, the same on every node: where the lighthouse listens (served by the node "
           "whose address HOST is, or by `ddpkit lighthouse`)"] if args.rdzv_endpoint is None else []),
        *([f"--group-size {args.group_size}: with --nnodes, each node's -n ranks are one group"]
          if args.group_size != 1 else []),
    ]  # fmt: skip
    if problems:
        return _fail("run", "--fault-tolerance --nnodes needs " + "; ".join(problems), status=2)
    try:
        return run_node_group(
            args.script, args.script_args, nnodes=int(args.nnodes), endpoint=args.rdzv_endpoint, nprocs=args.nprocs,
            replica_id=args.replica_id or os.environ.get("SLURMD_NODENAME"), max_restarts=args.max_restarts,
            module=args.module,
        )  # fmt: skip
    except ValueError as error:
        return _fail("run", error, status=2)
    except (ImportError, RendezvousFailedError, PortTakenError) as error:
        return _fail("run", error)


def _lighthouse(args: argparse.Namespace) -> int:
    from ddpkit.fault_tolerance._job import serve_until_interrupted

    try:
        return serve_until_interrupted(args.host, args.port, args.min_replicas)
    except ValueError as error:
        return _fail("lighthouse", error, status=2)
    except (ImportError, RendezvousFailedError, PortTakenError) as error:
        return _fail("lighthouse", error)


def _doctor(args: argparse.Namespace) -> int:
    from ddpkit.doctor import check_ranks

    failed = _use_secret_file("doctor", args.secret_file)
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
        return _fail("doctor", f"a rank failed before the checks could finish. {error}")
    except (RendezvousFailedError, PortTakenError) as error:
        return _fail("doctor", error)
    except ValueError as error:
        return _fail("doctor", error, status=2)
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


def _env(args: argparse.Namespace) -> int:
    try:
        data: dict[str, Any] = detect_environment().as_dict()
    except ClusterEnvironmentError as error:
        return _fail("env", error)
    data["torch"] = torch.__version__
    data["distributed_backends"] = [
        name
        for name, available in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if available
    ]
    data["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(json.dumps(data, indent=2))
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        if args.nprocs < 1:
            raise ValueError(f"--nprocs {args.nprocs}: nprocs={args.nprocs} must be an integer >= 1")
        from ddpkit.examples.demo_jobs import demo_job  # the demos' imports only for the demo

        job = demo_job(args)
    except ValueError as error:
        return _fail("demo", error, status=2)
    started = time.perf_counter()
    try:
        summary = job()
    except (WorkerFailedError, ValueError) as error:
        return _fail("demo", error)
    if detect_environment().global_rank() == 0:  # under srun or mpirun every task gets here
        print(summary.format(seconds=time.perf_counter() - started))
    return 0
