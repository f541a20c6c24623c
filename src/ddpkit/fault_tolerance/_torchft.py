"""torchft, imported when first needed, with the fix in the error when it is missing; the addresses of its servers."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from ddpkit._stores import route_address
from ddpkit.environments.base import is_loopback
from ddpkit.errors import RendezvousFailedError


def torchft_module(name: str = "torchft") -> ModuleType:
    """Import ``name`` (``torchft`` or one of its modules).

    torchft's core logs every quorum at info level; unless ``RUST_LOG`` is set,
    ddpkit sets it to ``warn`` first (this process and those it starts).

    Raises:
        ImportError: torchft is not installed; the message says how to install it.
    """
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        return importlib.import_module(name)
    except ImportError as missing:
        raise ImportError(
            f"per-step fault tolerance needs torchft ({name} could not be imported: {missing}); install it with "
            "pip install torchft==0.2.0 (ddpkit's ft extra)"
        ) from missing


def url_host(address: str) -> str:
    """``http://[::1]:29510`` -> ``::1``; ``host:port`` -> ``host``."""
    rest = address.partition("://")[2] or address
    rest = rest.split("/", 1)[0]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rpartition(":")[0] or rest


def bracketed(address: str) -> str:
    """An IPv6 address in brackets, for ``host:port``; others as they are."""
    return f"[{address}]" if ":" in address else address


def local_address(lighthouse: str) -> str:
    """Where a group's servers listen: loopback with a lighthouse on loopback, else this machine's address on its
    route to the lighthouse.

    Raises:
        RendezvousFailedError: no route from this machine to the lighthouse's host.
    """
    host = url_host(lighthouse)
    if is_loopback(host):
        return "127.0.0.1"
    address = route_address(host)
    if address is None:
        raise RendezvousFailedError(
            f"no route from this machine to the lighthouse at {lighthouse}: check its address and the network"
        )
    return address
