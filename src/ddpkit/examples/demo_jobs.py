"""``ddpkit demo``'s jobs: the checked options of the command line as a job that returns its summary line."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ddpkit.examples.demo import DemoConfig, run_demo
from ddpkit.examples.retrieval import RetrievalConfig, run_retrieval_demo

__all__ = ["demo_job"]


def demo_job(args: argparse.Namespace) -> Callable[[], str]:
    """The demo that ``args.task`` names, as a job that returns its summary line (with ``{seconds}`` to fill).

    Raises:
        ValueError: an option the demo cannot take (the message names it and the fix).
    """
    return _retrieval_job(args) if args.task == "retrieval" else _classification_job(args)


def _classification_job(args: argparse.Namespace) -> Callable[[], str]:
    """The checked configuration, as a job that returns its summary line (with ``{seconds}`` to fill)."""
    lr = 0.1 if args.lr is None else args.lr
    config = DemoConfig(
        args.epochs, args.batch_size, lr, args.seed, progress=not args.no_progress, logdir=args.logdir,
        lr_schedule=args.lr_schedule, precision=args.precision, clip=args.clip,
    )  # fmt: skip

    def job() -> str:
        result = run_demo(args.nprocs, config)
        return (
            f"ddpkit demo: {result.world_size} processes (gloo), {len(result.train_losses)} epochs, "
            f"{{seconds:.1f}} s in all; final train loss {result.train_losses[-1]:.4f}, "
            f"validation accuracy {result.val_accuracy:.4f} ({result.val_correct}/{result.val_total})"
        )

    return job


def _retrieval_job(args: argparse.Namespace) -> Callable[[], str]:
    per_class = 4
    if args.batch_size % per_class:
        raise ValueError(
            f"--batch-size {args.batch_size} must be a multiple of {per_class}: retrieval batches hold P "
            f"classes x {per_class} samples (e.g. --batch-size 32 for P=8)"
        )
    lr = 0.1 if args.lr is None else args.lr
    config = RetrievalConfig(
        args.epochs, args.batch_size // per_class, per_class, lr, seed=args.seed, progress=not args.no_progress
    )

    def job() -> str:
        result = run_retrieval_demo(args.nprocs, config)
        return (
            f"ddpkit demo --task retrieval: {result.world_size} processes (gloo), {len(result.train_losses)} "
            f"epochs, {{seconds:.1f}} s in all; final triplet loss {result.train_losses[-1]:.4f}, validation "
            f"precision@1 {result.precision_at_1:.4f} (untrained {result.initial_precision_at_1:.4f})"
        )

    return job
