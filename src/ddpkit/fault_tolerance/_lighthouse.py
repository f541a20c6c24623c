"""torchft's lighthouse (the quorum server), listening on one address."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ddpkit._stores import hosting_address
from ddpkit.fault_tolerance._torchft import bracketed, torchft_module


class Lighthouse:
    """A running lighthouse: :attr:`address` is what every replica group is given (``http://HOST:PORT``).

    A context manager: leaving it shuts the server down (as :meth:`shutdown`).
    """

    def __init__(self, server: Any, address: str) -> None:
        self._server = server
        #: ``http://HOST:PORT``, with the address it listens on (not a host name).
        self.address = address

    def shutdown(self) -> None:
        """Stop the server (the replica groups then cannot form a quorum)."""
        self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.shutdown()


def serve_lighthouse(
    host: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1, join_timeout: float = 0.5,
    heartbeat_timeout: float = 1.0,
) -> Lighthouse:  # fmt: skip
    """Start torchft's lighthouse in this process, listening on ``host``'s address only (torchft's
    ``torchft_lighthouse``, bound as ddpkit binds its stores).

    torchft serves it without authentication: whoever reaches the port can read its dashboard (the groups' ids,
    steps and addresses), kill any replica group from it (``POST /replica/<id>/kill``) and ask for quorums (with
    a job secret, a process without it gets into no quorum's process group, but each quorum it is in fails a
    step). Keep ``host`` on loopback or on a network only the job's nodes reach.

    Args:
        host: a loopback name (one machine), or this machine's address on the network the replica groups
            share (never every interface).
        port: the port; 0 (default) picks a free one.
        min_replicas: the fewest replica groups a quorum needs (default 1).
        join_timeout: seconds a quorum waits for groups that are heartbeating but not yet asking to join
            (default 0.5).
        heartbeat_timeout: seconds without a heartbeat after which a group counts as gone (default 1.0).

    Raises:
        RendezvousFailedError: ``host`` is none of this machine's addresses (the message lists them).
        ImportError: torchft is not installed (the message says how to install it).
        ValueError: ``min_replicas`` below 1, or a timeout that is not positive.
    """
    if min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas} must be at least 1")
    if join_timeout <= 0 or heartbeat_timeout <= 0:
        raise ValueError(
            f"join_timeout={join_timeout} and heartbeat_timeout={heartbeat_timeout} must be positive (seconds)"
        )
    address = bracketed(hosting_address(host, "torchft's lighthouse"))
    server = torchft_module("torchft._torchft").LighthouseServer(
        bind=f"{address}:{port}", min_replicas=min_replicas, join_timeout_ms=round(join_timeout * 1000),
        heartbeat_timeout_ms=round(heartbeat_timeout * 1000),
    )  # fmt: skip
    bound_port = int(str(server.address()).rstrip("/").rpartition(":")[2])
    return Lighthouse(server, f"http://{address}:{bound_port}")
