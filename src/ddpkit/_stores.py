"""TCP stores that listen on one address, and the addresses of this machine (private).

``torch.distributed.TCPStore`` listens on every interface of the machine, whatever
host it is given: a run would expose its rendezvous and process-group stores to
every network the machine is on. ddpkit binds the listening socket to the one
address the job was told (loopback on a single node; on several nodes, the
rendezvous host's address, or this node's address on its route to it) and hands
it to ``TCPStore`` (``master_listen_fd``), as a *multi-tenant* server: every
``TCPStore(host, port, is_master=True, multi_tenant=True)`` that torch creates
later in this process on the same port (the elastic agent's c10d rendezvous,
``init_process_group``'s ``env://``) reuses it instead of binding all interfaces.
"""

from __future__ import annotations

import atexit
import errno
import ipaddress
import itertools
import socket
import threading
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit.environments import is_loopback
from ddpkit.errors import PortTakenError, RendezvousFailedError

__all__ = [
    "ForwardingStore",
    "IfTaken",
    "LoopbackHostError",
    "hosting_address",
    "local_addresses",
    "release_store",
    "route_address",
    "serve_store",
]

IfTaken = Literal["raise", "peer", "torch"]


class ForwardingStore(dist.Store):  # type: ignore[misc, name-defined]  # torch does not type it
    """A store that does what ``inner`` does: the base of the stores that change part of it (signed values, waits
    with one deadline). A torch ``Store`` itself, so that torch's process groups take it."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._inner.get(key))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return bytes(self._inner.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout  # type: ignore[no-any-return]


_LOCK = threading.Lock()
#: The servers this process hosts, by port, with how many holders have not released them yet.
_SERVERS: dict[int, tuple[TCPStore, int]] = {}


def serve_store(host: str, port: int, *, if_taken: IfTaken = "raise", timeout: float = 300.0) -> int | None:
    """Host a multi-tenant store server on ``host``'s address only, on ``port`` (0: a free port).

    Within a process, each call for a port already served adds a holder; the
    server stops when every holder has called :func:`release_store`,
    or at interpreter exit. Returns the port it listens on, or ``None`` when
    ``host`` is neither a loopback name nor an IP address of this machine (a
    host name is left to torch: the address other machines resolve it to is
    not known here) or when the port is held already and ``if_taken`` allows it.

    Args:
        host: the store's address: a loopback name, or an IP address of this machine.
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
    found = _address(host)
    if found is None:
        return None
    family, address = found
    with _LOCK:
        if port and port in _SERVERS:
            server, holders = _SERVERS[port]
            _SERVERS[port] = (server, holders + 1)
            return port
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, port))
            listener.listen(1024)
        except OSError as exc:
            listener.close()
            if exc.errno == errno.EADDRNOTAVAIL and not is_loopback(host):
                return None  # not an address of this machine: torch's client (or its error)
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


def release_store(port: int | None) -> None:
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


def _address(host: str) -> tuple[socket.AddressFamily, str] | None:
    """The family and address to bind for ``host``: an IP address as it is, a loopback name as 127.0.0.1
    (clients resolve ``localhost`` to it first), any other name ``None``."""
    try:
        version = ipaddress.ip_address(host).version
    except ValueError:
        return (socket.AF_INET, "127.0.0.1") if is_loopback(host) else None
    return (socket.AF_INET6, host) if version == 6 else (socket.AF_INET, host)


def local_addresses() -> list[str]:
    """This machine's IP addresses (IPv4 then IPv6), for messages; empty where they cannot be listed.

    Read from ``/proc/net/fib_trie`` (every local IPv4 address, secondary ones
    included) and ``/proc/net/if_inet6`` on Linux.
    """
    found: list[str] = []
    try:
        with open("/proc/net/fib_trie") as trie:
            lines = trie.read().splitlines()
        for previous, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                address = previous.strip().removeprefix("|-- ")
                if address not in found:
                    found.append(address)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6") as table:
            for row in table:
                digits = row.split()[0]
                found.append(str(ipaddress.IPv6Address(int(digits, 16))))
    except (OSError, ValueError, IndexError):
        pass
    return found


def route_address(host: str) -> str | None:
    """This machine's address on its route to ``host`` (what the kernel would send from), or ``None``
    when ``host`` does not resolve or no route leads there. No packet is sent."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, target in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(target)  # UDP: only picks the route and source address
            except OSError:
                continue
            return str(probe.getsockname()[0])
    return None


class LoopbackHostError(RendezvousFailedError):
    """The host to serve on names this machine through loopback addresses only (``addresses``), where the other
    nodes could not reach what is served (Debian maps a machine's own name to 127.0.1.1)."""

    def __init__(self, message: str, addresses: list[str]) -> None:
        super().__init__(message)
        self.addresses = addresses


def hosting_address(host: str, serving: str = "the rendezvous") -> str:
    """The address of this machine that ``host`` (the rendezvous host) names, to serve its store on
    (``serving``: what is served there, for the message: ``"torchft's lighthouse"``, say).

    Raises:
        RendezvousFailedError: ``host`` names none of this machine's addresses
            (the message names the host and the addresses this machine has),
            or (:class:`LoopbackHostError`) only a loopback one while the name
            is not loopback (the other nodes could not reach a store there).
    """
    if is_loopback(host):
        return "127.0.0.1" if _address(host) is None else host
    try:
        candidates = [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        candidates = []
    mine = local_addresses()
    usable = [address for address in candidates if _is_mine(address, mine)]
    remote = [address for address in usable if not ipaddress.ip_address(address.partition("%")[0]).is_loopback]
    if remote:
        return remote[0]
    what = f"resolves to {', '.join(candidates)}" if candidates else "does not resolve"
    if usable:
        what += ", a loopback address on this machine, where the other nodes could not reach it"
    rendezvous = serving == "the rendezvous"
    give = "the rendezvous endpoint" if rendezvous else "its host"
    message = (
        f"this node is to host {serving} at {host}, but {host} {what}; this machine's addresses are "
        f"{', '.join(mine) or '(they could not be listed)'}. Give {give} as this machine's address on the network "
        "that reaches the other nodes" + (", or start this node with is_host=false" if rendezvous else "")
    )
    if usable:
        raise LoopbackHostError(message, sorted(set(candidates)))
    raise RendezvousFailedError(message)


def _is_mine(address: str, mine: list[str]) -> bool:
    if address in mine:
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


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
