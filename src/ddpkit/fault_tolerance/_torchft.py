"""torchft, imported when first needed, with the fix in the error when it is missing."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


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
