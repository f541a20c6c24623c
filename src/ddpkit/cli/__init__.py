"""The ``ddpkit`` command: ``run``, ``doctor``, ``lighthouse``, ``secret``, ``env`` and ``demo``, a module each."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ddpkit import __version__
from ddpkit.cli import _demo, _doctor, _env, _lighthouse, _run, _secret

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ddpkit`` and its sub-commands."""
    parser = argparse.ArgumentParser(
        prog="ddpkit",
        description="Correct PyTorch DDP training, from one CPU laptop to a multi-node cluster.",
    )
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (_run, _doctor, _lighthouse, _secret, _env, _demo):
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status
