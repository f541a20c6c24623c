"""TCP stores that listen on the loopback interface only (private).

``torch.distributed.TCPStore`` listens on every interface of the machine, whatever
host it is given: a single-node run would expose its rendezvous and process-group
stores to the network. For a loopback host, ddpkit binds the listening socket to
the loopback address itself and hands it to ``TCPStore`` (``master_listen_fd``),
as a *multi-tenant* server: every ``TCPStore(host, port, is_master=True,
multi_tenant=True)`` that torch creates later in this process on the same port
(the elastic agent's c10d rendezvous, ``init_process_group``'s ``env://``) reuses
it instead of binding all interfaces.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import socket
import threading
from datetime import timedelta
from typing import Literal

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit.environments import is_loopback
from ddpkit.errors import PortTakenError

__all__ = ["IfTaken", "release_loopback_store", "serve_on_loopback"]

IfTaken = Literal["raise", "peer", "torch"]

_LOCK = threading.Lock()
#: The servers this process hosts, by port, with how many holders have not released them yet.
_SERVERS: dict[int, tuple[TCPStore, int]] = {}


def serve_on_loopback(host: str, port: int, *, if_taken: IfTaken = "raise", timeout: float = 300.0) -> int | None:
    """Host a multi-tenant store server on ``host``'s loopback address and ``port`` (0: a free port).

    Within a process, each call for a port already served adds a holder; the
    server stops when every holder has called :func:`release_loopback_store`,
    or at interpreter exit. Returns the port it listens on, or
    ``None`` when ``host`` is not a loopback name (then torch's own server,
    listening on every interface, is what remote peers need) or when the port is
    held already and ``if_taken`` allows it.

    Args:
        host: the store's address; only loopback names are served.
        port: the port; 0 picks a free one.
        if_taken: when another process holds the port: ``"raise"``
            :class:`PortTakenError`; ``"peer"`` return ``None`` if a store answers
            there (another agent of a multi-node run on this machine), else
            raise; ``"torch"`` return ``None`` and let torch bind (and report).
        timeout: the server's store timeout, in seconds.

    Raises:
        PortTakenError: the port is held by something this call may not share;
            the message names the port and the fix.
    """
    if not is_loopback(host):
        return None
    with _LOCK:
        if port and port in _SERVERS:
            server, holders = _SERVERS[port]
            _SERVERS[port] = (server, holders + 1)
            return port
        family, address = _loopback_address(host)
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(1024)
        except OSError as exc:
            listener.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            if if_taken == "torch" or (if_taken == "peer" and _answers_as_store(address, port)):
                return None
            holder = "another program (not a torch.distributed store)" if if_taken == "peer" else "another program"
            raise PortTakenError(
                f"port {port} on {address} is taken by {holder}, so the store cannot listen there; choose a free "
                f"port (port 0 picks one on a single node) or stop the program that holds it "
                f"(`ss -ltnp | grep :{port}` shows which)"
            ) from exc
        bound = int(listener.getsockname()[1])
        server = TCPStore(
            address,
            bound,
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            master_listen_fd=listener.detach(),  # the store owns the socket from here on
        )
        if not _SERVERS:
            atexit.register(_release_all)
        _SERVERS[bound] = (server, 1)
        return bound


def release_loopback_store(port: int | None) -> None:
    """Drop one holder of the server on ``port``; the last one stops hosting it (it closes once torch's own
    handles are gone too)."""
    with _LOCK:
        if port is None or port not in _SERVERS:
            return
        server, holders = _SERVERS[port]
        if holders > 1:
            _SERVERS[port] = (server, holders - 1)
        else:
            del _SERVERS[port]


def _release_all() -> None:
    """At exit, stop the servers while the interpreter is whole, not during its teardown."""
    with _LOCK:
        _SERVERS.clear()


def _loopback_address(host: str) -> tuple[socket.AddressFamily, str]:
    try:
        if ipaddress.ip_address(host).version == 6:
            return socket.AF_INET6, host
        return socket.AF_INET, host
    except ValueError:  # "localhost": clients resolve it to 127.0.0.1 first
        return socket.AF_INET, "127.0.0.1"


def _answers_as_store(address: str, port: int, wait: float = 3.0) -> bool:
    """Whether a TCPStore answers on ``address:port`` within ``wait`` seconds.

    A client's handshake with something that is not a store never ends (its
    timeout does not cover it), so it runs in a daemon thread that is abandoned
    after ``wait``.
    """
    answered = threading.Event()

    def probe() -> None:
        try:
            TCPStore(address, port, is_master=False, timeout=timedelta(seconds=wait)).check(["ddpkit/probe"])
        except Exception:  # any failure means: not a store we can use
            return
        answered.set()

    threading.Thread(target=probe, name="ddpkit-store-probe", daemon=True).start()
    return answered.wait(wait)
