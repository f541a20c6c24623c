"""A cluster environment as Lightning defines one, whichever version: what ``init_dist_connection`` and
``DDPPlugin.init_ddp_connection`` accept besides ddpkit's own environments, and how its address is read."""

from __future__ import annotations

from typing import Protocol

__all__ = ["SupportsClusterEnvironment", "SupportsMainAddress", "main_address_and_port", "optional_int_method"]


class SupportsClusterEnvironment(Protocol):
    """A cluster environment as Lightning 1.x defines one: ``master_address()`` and ``master_port()`` methods.

    ``global_rank()`` and ``local_rank()`` are used when present.
    """

    def master_address(self) -> str: ...

    def master_port(self) -> int: ...

    def world_size(self) -> int: ...


class SupportsMainAddress(Protocol):
    """A cluster environment as Lightning 1.6+ and 2.x define one: ``main_address`` and ``main_port`` properties.

    ``global_rank()`` and ``local_rank()`` are used when present.
    """

    @property
    def main_address(self) -> str: ...

    @property
    def main_port(self) -> int: ...

    def world_size(self) -> int: ...


def main_address_and_port(env: SupportsClusterEnvironment | SupportsMainAddress) -> tuple[str, int]:
    """A cluster environment's rank-0 address and port: ``master_address()``/``master_port()`` (Lightning 1.x,
    ddpkit's environments), else the ``main_address``/``main_port`` properties (Lightning 1.6+ and 2.x).

    Raises:
        TypeError: ``env`` has neither.
    """
    if callable(getattr(env, "master_address", None)) and callable(getattr(env, "master_port", None)):
        return str(env.master_address()), int(env.master_port())  # type: ignore[union-attr]
    if hasattr(env, "main_address") and hasattr(env, "main_port"):
        address, port = env.main_address, env.main_port
        return str(address() if callable(address) else address), int(port() if callable(port) else port)
    raise TypeError(
        f"{type(env).__name__} is not a cluster environment: it needs master_address() and master_port() methods "
        "(Lightning 1.x) or main_address and main_port properties (Lightning 2.x)"
    )


def optional_int_method(obj: object, name: str, override: int | None) -> int | None:
    """``override``, else what ``obj``'s method ``name`` returns as an integer, else ``None`` (no such method)."""
    if override is not None:
        return int(override)
    method = getattr(obj, name, None)
    return int(method()) if callable(method) else None
