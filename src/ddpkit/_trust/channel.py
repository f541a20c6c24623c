"""What a member of a gloo group sees of the group's TCP connections, and whether the members' views of them agree
(private): the channel that the group proof binds.

A challenge and response over a group's connections proves who answers at the
other end, not that the other end is the member itself: a relay that sits on
two connections (A to relay, relay to B) passes every message on and passes the
proof. Each member therefore says, in its proof (so nobody can change it), what
it sees of its connections: the addresses it listens on, for each member it
connected to, the address it connected from, and the addresses its inbound
connections came from. Both ends of one TCP connection see the same two
addresses, mirrored; a relay's two connections do not: A connected from ``a``
but B's connection came from the relay's address, so both A and B find the
mismatch, naming the addresses.

Read on Linux from ``/proc/self/fd`` (this process's sockets) and
``/proc/net/tcp``/``tcp6`` (their addresses). Elsewhere, or for NCCL's
connections (not TCP sockets of this process that gloo's addresses name), a
member says nothing and the check passes over it. A network that rewrites
addresses between the members (NAT) cannot be told apart from a relay;
gloo needs the members to reach each other's own addresses in any case.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Channel", "established_connections"]


def established_connections() -> list[tuple[str, str]] | None:
    """``(local, remote)`` ``"HOST:PORT"`` addresses of this process's established TCP connections (IPv4 and IPv6;
    an IPv4-mapped IPv6 address as IPv4), or ``None`` where they cannot be read (not Linux)."""
    try:
        inodes = set()
        for entry in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{entry}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
            try:
                with open(table) as rows:
                    lines = rows.read().splitlines()[1:]
            except FileNotFoundError:
                continue
            for line in lines:
                fields = line.split()
                if len(fields) > 9 and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                    found.append((_address(fields[1], family), _address(fields[2], family)))
        return found
    except OSError:
        return None


def _address(hexed: str, family: int) -> str:
    """``/proc/net/tcp``'s ``HEX_IP:HEX_PORT`` as ``"HOST:PORT"`` (each 32-bit word of the IP is in host order)."""
    ip, port = hexed.split(":")
    words = bytes.fromhex(ip)
    raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
    return normal(
        f"{ipaddress.ip_address(raw)}:{int(port, 16)}"
        if family == 4
        else f"[{ipaddress.ip_address(raw)}]:{int(port, 16)}"
    )


def normal(address: str) -> str:
    """``"HOST:PORT"`` with an IPv4-mapped IPv6 host as IPv4 (``[::ffff:10.0.0.1]:80`` -> ``10.0.0.1:80``) and IPv6
    in brackets, compressed."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


@dataclass(frozen=True)
class Channel:
    """One member's view of a gloo group's connections.

    Args:
        rank: this member's rank in the group.
        listen: every member's listening addresses (``"HOST:PORT"``) by rank, as this member read them in the
            group's store (signed), its own included.
        connections: this process's established TCP connections, ``(local, remote)`` (default: read now), or
            ``None`` where they cannot be read.
    """

    rank: int
    listen: Mapping[int, list[str]]
    connections: list[tuple[str, str]] | None = field(default_factory=established_connections)

    def view(self) -> bytes:
        """What this member says of the group's connections (its proof covers it): ``b""`` when it cannot tell."""
        if self.connections is None or not self.listen.get(self.rank):
            return b""
        mine = {normal(address) for address in self.listen[self.rank]}
        said = {
            "listen": sorted(mine),
            "in": sorted({remote for local, remote in self.connections if local in mine}),
            "out": {str(peer): sorted(self._out(peer)) for peer in self.listen if peer != self.rank},
        }
        return json.dumps(said, sort_keys=True, separators=(",", ":")).encode()

    def _out(self, peer: int) -> set[str]:
        """The local addresses of this member's connections to ``peer``'s listening addresses."""
        theirs = {normal(address) for address in self.listen.get(peer, [])}
        return {local for local, remote in self.connections or [] if remote in theirs}

    def mismatch(self, member: int, said: bytes) -> str | None:
        """Why ``member``'s view (``said``, from its proof) and this member's of the connections between them do
        not agree, naming the addresses; ``None`` when they agree or either cannot tell."""
        if not said or self.connections is None or not self.listen.get(self.rank):
            return None
        theirs = json.loads(said)
        listens, came_in = set(theirs.get("listen", [])), set(theirs.get("in", []))
        told = {normal(address) for address in self.listen.get(member, [])}
        if told and listens and not told & listens:
            return (
                f"the group's store gave this rank {', '.join(sorted(told))} as its address, but it listens on "
                f"{', '.join(sorted(listens))}"
            )
        for local in sorted(self._out(member)):
            if local not in came_in:
                seen = ", ".join(theirs.get("in", [])) or "nowhere"
                return (
                    f"this rank connected to it from {local}, but the connections that reached it came from {seen}: "
                    "something between them relays"
                )
        mine = {normal(address) for address in self.listen[self.rank]}
        reached = {remote for local, remote in self.connections if local in mine}
        for local in theirs.get("out", {}).get(str(self.rank), []):
            if local not in reached:
                seen = ", ".join(sorted(reached)) or "nowhere"
                return (
                    f"it connected to this rank from {local}, but the connections that reached this rank came from "
                    f"{seen}: something between them relays"
                )
        return None
