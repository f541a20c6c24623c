"""torchft's lighthouse (the quorum server), listening on one address, with the job's record beside it."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from ddpkit._stores import hosting_address
from ddpkit._trust.secret import job_secret
from ddpkit.errors import PortTakenError
from ddpkit.fault_tolerance._record import RECORD_PORT_OFFSET, RecordServer
from ddpkit.fault_tolerance._torchft import bracketed, torchft_module

#: Free ports tried, when none was given, for a lighthouse whose next port is free for the job's record.
_PORT_TRIES = 20


class Lighthouse:
    """A running lighthouse: :attr:`address` is what every replica group is given (``http://HOST:PORT``); the
    job's record listens on the next port (:attr:`record`).

    A context manager: leaving it shuts the server down (as :meth:`shutdown`).
    """

    def __init__(self, server: Any, address: str, record: RecordServer) -> None:
        self._server, self._record = server, record
        #: ``http://HOST:PORT``, with the address it listens on (not a host name).
        self.address = address
        #: ``HOST:PORT`` of the job's record (the lighthouse's port + 1).
        self.record = f"{bracketed(record.host)}:{record.port}"

    def shutdown(self) -> None:
        """Stop the server and the job's record (the replica groups then cannot form a quorum)."""
        self._server.shutdown()
        self._record.close()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.shutdown()


def serve_lighthouse(
    host: str = "127.0.0.1", port: int = 0, *, min_replicas: int = 1, join_timeout: float = 0.5,
    heartbeat_timeout: float = 1.0, secret: bytes | None = None,
) -> Lighthouse:  # fmt: skip
    """Start torchft's lighthouse in this process, listening on ``host``'s address only (torchft's
    ``torchft_lighthouse``, bound as ddpkit binds its stores), and the job's record on the next port.

    The record keeps how far the job got (the highest step committed, and which processes hold that state) and
    whether it finished, for as long as this lighthouse runs: a quorum that is behind it does not train (it
    waits for, or takes the state from, a group that holds the job's state), and a group that comes back after
    the job finished trains nothing. Its values are signed with the job secret (``secret``, default
    ``$DDPKIT_JOB_SECRET``): the replica groups need the same one.

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
        secret: the job secret (bytes); default the one in ``$DDPKIT_JOB_SECRET``, else none.

    Raises:
        RendezvousFailedError: ``host`` is none of this machine's addresses (the message lists them).
        PortTakenError: ``port`` + 1 is taken (the job's record listens there).
        ImportError: torchft is not installed (the message says how to install it).
        ValueError: ``min_replicas`` below 1, or a timeout that is not positive.
    """
    if min_replicas < 1:
        raise ValueError(f"min_replicas={min_replicas} must be at least 1")
    if join_timeout <= 0 or heartbeat_timeout <= 0:
        raise ValueError(
            f"join_timeout={join_timeout} and heartbeat_timeout={heartbeat_timeout} must be positive (seconds)"
        )
    bound = hosting_address(host, "torchft's lighthouse")
    address = bracketed(bound)
    secret = job_secret() if secret is None else secret
    servers = torchft_module("torchft.coordination")
    for attempt in range(1, _PORT_TRIES + 1):
        server = servers.LighthouseServer(
            bind=f"{address}:{port}", min_replicas=min_replicas, join_timeout_ms=round(join_timeout * 1000),
            heartbeat_timeout_ms=round(heartbeat_timeout * 1000),
        )  # fmt: skip
        bound_port = int(str(server.address()).rstrip("/").rpartition(":")[2])
        try:
            record = RecordServer(bound, bound_port + RECORD_PORT_OFFSET, secret)
        except PortTakenError:
            server.shutdown()
            if port == 0 and attempt < _PORT_TRIES:
                continue  # another free port, whose next one is free too
            raise PortTakenError(
                f"port {bound_port + RECORD_PORT_OFFSET} of {bound} is taken, and the job's record listens on the "
                f"lighthouse's port + 1: pick another port for the lighthouse (the same on every node), or stop the "
                "program that holds it"
            ) from None
        return Lighthouse(server, f"http://{address}:{bound_port}", record)
    raise AssertionError("unreachable")
