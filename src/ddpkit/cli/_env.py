"""``ddpkit env``: the detected cluster environment, as JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.cli._common import fail
from ddpkit.environments import detect_environment
from ddpkit.errors import ClusterEnvironmentError

__all__ = ["add_parser", "handle"]


def add_parser(commands: Any) -> None:
    """``ddpkit env``'s arguments, on the ``COMMAND`` sub-parsers ``commands``."""
    env = commands.add_parser("env", help="print the detected cluster environment as JSON")
    env.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    try:
        data: dict[str, Any] = detect_environment().as_dict()
    except ClusterEnvironmentError as error:
        return fail("env", error)
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
