"""``ddpkit secret PATH``: a job secret file for ``--secret-file``."""

from __future__ import annotations

import argparse
from typing import Any

from ddpkit._trust.secret import write_secret_file
from ddpkit.cli._common import fail

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit secret``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
    secret = commands.add_parser(
        "secret",
        help="make a job secret file (256 random bits, readable by you alone)",
        description="Create PATH holding a new job secret: 64 random hex digits, mode 0600. Give it to every node "
        "of a job with --secret-file PATH (keep it in a directory every node mounts, e.g. your home). An existing "
        "file is never overwritten.",
    )
    secret.add_argument("path", metavar="PATH", help="the file to create")
    secret.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        write_secret_file(args.path)
    except FileExistsError:
        return fail("secret", f"{args.path} exists; a job may be using it, so it is left as it is", status=2)
    except OSError as error:
        return fail("secret", error, status=2)
    print(f"ddpkit secret: wrote a new job secret (256 random bits, readable by you alone) to {args.path}; "
          f"give it to every node: --secret-file {args.path}")  # fmt: skip
    return 0
