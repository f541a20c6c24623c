"""What several test modules share: security."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.helpers import listening_sockets, refused

# 127.0.0.2 is another address of this machine's loopback interface: a socket bound to every
# interface answers there, one bound to 127.0.0.1 does not. Nothing here leaves the machine.
OTHER_LOCAL_ADDRESS = "127.0.0.2"


def _check_exposure(pids: list[int]) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(every listening socket of ``pids``, those that also answer on another local address)."""
    sockets = listening_sockets(pids)
    return sockets, [(address, port) for address, port in sockets if not refused(OTHER_LOCAL_ADDRESS, port)]


def _mark(path: str) -> None:
    """What a crafted pickle runs when unpickled: leaves a file named after the rank that ran it."""
    Path(f"{path}.rank{dist.get_rank()}").write_text("code ran here")


class _Exploit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_mark, (self.path,))
