"""``ddpkit demo``: the digits trained with DDP on CPU processes (the quick start's main job)."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ddpkit.cli._common import fail
from ddpkit.environments import detect_environment
from ddpkit.errors import WorkerFailedError

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit demo``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
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
    demo.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        if args.nprocs < 1:
            raise ValueError(f"--nprocs {args.nprocs}: nprocs={args.nprocs} must be an integer >= 1")
        from ddpkit.examples.demo_jobs import demo_job  # the demos' imports only for the demo

        job = demo_job(args)
    except ValueError as error:
        return fail("demo", error, status=2)
    started = time.perf_counter()
    try:
        summary = job()
    except (WorkerFailedError, ValueError) as error:
        return fail("demo", error)
    if detect_environment().global_rank() == 0:  # under srun or mpirun every task gets here
        print(summary.format(seconds=time.perf_counter() - started))
    return 0
