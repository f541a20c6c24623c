"""Helpers that tests import: is a process alive, which sockets does it listen on, is a port closed."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from pathlib import Path

__all__ = ["alive", "listening_sockets", "refused"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def listening_sockets(pids: list[int]) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket the processes ``pids`` listen on (Linux ``/proc``)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, PermissionError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError), open(f"/proc/net/{table}") as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:  # 0A: LISTEN
                    continue
                address, port = local.split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return sorted(found)


def refused(address: str, port: int) -> bool:
    """Whether a TCP connection to ``address:port`` is refused."""
    with socket.socket() as probe:
        probe.settimeout(2)
        try:
            probe.connect((address, port))
        except OSError:
            return True
    return False
