"""The fixed-size record every ddpkit gather starts with: the one place that touches memory through ``ctypes``.

Each rank sends a record of the same size (``capacity`` bytes, so the first
collective cannot mismatch). It is a frame of :mod:`ddpkit.collectives._framing`:

==================================  ==========================================================
bytes                               what
==================================  ==========================================================
0-1                                 magic ``b"DK"``
2                                   version (1)
3                                   flags: ``HEAD_INLINE`` (1) the header follows;
                                    ``BODY_INLINE`` (2) the payload follows it too
4-7                                 the header's length in bytes (u32, little-endian)
8-15                                the payload's length in bytes (u64, little-endian)
16 to 16 + header length            the encoded header, when ``HEAD_INLINE``
``align(16 + header length)`` on    the payload's raw bytes, when ``BODY_INLINE``
the rest, up to ``capacity``        zeros
==================================  ==========================================================

A header that does not fit leaves both flags off (the header and the payload
then travel in a second step); a payload that does not fit leaves
``BODY_INLINE`` off. Right after a blocking collective every torch call costs
several times its usual time here, so :func:`write` builds the record with one
tensor allocation and ``ctypes.memmove`` (8 us), and :func:`read_all` parses
every rank's record in place; :func:`write_plain` is the same record built from
torch operations only, which a test compares byte for byte.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, NamedTuple, TypedDict

import torch

from ddpkit.collectives._framing import BODY_INLINE, HEAD_INLINE, MAGIC, PREFIX, VERSION, body_offset, pack_prefix
from ddpkit.errors import DDPKitError

__all__ = ["Header", "RecordView", "host_bytes", "memory_of", "read_all", "write", "write_plain"]


class Header(TypedDict, total=False):
    """A record's metadata (JSON in the record's head, or a compact form for a tensor's): each collective sends
    the fields it needs, and every rank reads every rank's before any data moves."""

    error: list[str]  # [exception type name, message]: this rank's own input was bad; it sends no data
    dtype: str  # a tensor's dtype name ("float32") ...
    shape: list[int]  # ... and shape (gathers)
    keys: list[Any]  # a dict's keys, in order (value sync) ...
    values: list[Any]  # ... each value's kind, dtype and shape (``KeyMeta`` on the wire) ...
    inline: bool  # ... and whether the values ride in the record
    desc: str  # sync_ddp's description of its input, sent only to name a mismatch


class RecordView(NamedTuple):
    """What one rank's record says (a tuple: built for every rank on every gather).

    Attributes:
        header_bytes: the header's length (inline or not).
        payload_bytes: the payload's length (inline or not).
        header: the decoded header when it was inline, else ``None``.
        payload_inline: the payload is in the record, at :attr:`payload_offset`.
    """

    header_bytes: int
    payload_bytes: int
    header: Header | None
    payload_inline: bool

    @property
    def payload_offset(self) -> int:
        """Where the payload starts in the record."""
        return body_offset(self.header_bytes)


def _flags(head: bytes, nbytes: int, capacity: int) -> int:
    header_inline = PREFIX.size + len(head) <= capacity
    payload_inline = header_inline and body_offset(len(head)) + nbytes <= capacity
    return (HEAD_INLINE if header_inline else 0) | (BODY_INLINE if payload_inline else 0)


def write(head: bytes, payload: torch.Tensor | None, nbytes: int, capacity: int, copies: int = 1) -> torch.Tensor:
    """This rank's record (a CPU ``uint8`` tensor of ``capacity`` bytes), written straight into its memory.

    Args:
        head: the encoded header.
        payload: the payload (its first ``nbytes`` raw bytes are sent), or ``None``.
        nbytes: the payload's length in bytes.
        capacity: the record's size.
        copies: the record this many times in a row (``copies * capacity`` bytes): what an ``all_to_all``
            sends, one copy to each rank.
    """
    flags = _flags(head, nbytes, capacity)
    record = torch.empty(capacity * copies, dtype=torch.uint8)  # the torch call the gather's output makes too
    address = record.data_ptr()
    ctypes.memset(address, 0, capacity)
    ctypes.memmove(address, pack_prefix(len(head), nbytes, flags), PREFIX.size)
    if flags & HEAD_INLINE and head:
        ctypes.memmove(address + PREFIX.size, head, len(head))
    if flags & BODY_INLINE and nbytes:
        assert payload is not None
        host = payload if payload.is_cpu and payload.is_contiguous() else payload.contiguous().cpu()
        ctypes.memmove(address + body_offset(len(head)), host.data_ptr(), nbytes)
    for copy in range(1, copies):
        ctypes.memmove(address + copy * capacity, address, capacity)
    return record


def write_plain(head: bytes, payload: torch.Tensor | None, nbytes: int, capacity: int) -> torch.Tensor:
    """:func:`write`, with torch operations only (slower; the reference a test compares against)."""
    flags = _flags(head, nbytes, capacity)
    record = torch.zeros(capacity, dtype=torch.uint8)
    record[: PREFIX.size] = torch.frombuffer(bytearray(pack_prefix(len(head), nbytes, flags)), dtype=torch.uint8)
    if flags & HEAD_INLINE and head:
        record[PREFIX.size : PREFIX.size + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if flags & BODY_INLINE and nbytes:
        assert payload is not None
        start = body_offset(len(head))
        record[start : start + nbytes] = payload.detach().contiguous().cpu().reshape(-1).view(torch.uint8)[:nbytes]
    return record


def read_all(records: torch.Tensor, capacity: int, decode: Callable[[bytes], Header]) -> list[RecordView]:
    """Every rank's record in ``records`` (``world_size * capacity`` bytes, rank order), parsed in place.

    Raises:
        DDPKitError: a rank sent something other than a record (the ranks are not
            running the same collectives in the same order).
    """
    host = records if records.device.type == "cpu" else records.cpu()
    size = host.numel()
    memory = memory_of(host)
    views = []
    for offset in range(0, size, capacity):  # one loop, no calls but the decoder's: it runs on every gather
        magic, version, flags, header_bytes, payload_bytes = PREFIX.unpack_from(memory, offset)
        if magic != MAGIC or version != VERSION:
            raise DDPKitError(
                f"rank {offset // capacity} sent something other than a ddpkit record (magic {magic!r}, version "
                f"{version}): the ranks are not running the same collectives in the same order"
            )
        start = offset + PREFIX.size
        header = decode(memory[start : start + header_bytes]) if flags & HEAD_INLINE else None
        views.append(RecordView(header_bytes, payload_bytes, header, bool(flags & BODY_INLINE)))
    return views


def memory_of(host: torch.Tensor) -> Any:
    """A CPU tensor's bytes as a ``ctypes`` char array, read in place (its slices are ``bytes``, and
    ``struct.unpack_from`` reads it); the caller keeps ``host`` alive while it reads."""
    return (ctypes.c_char * (host.numel() * host.element_size())).from_address(host.data_ptr())


def host_bytes(tensor: torch.Tensor) -> bytes:
    """A copy of a 1-D ``uint8`` tensor's bytes (read straight from memory on the CPU)."""
    host = tensor if tensor.device.type == "cpu" else tensor.cpu()
    return ctypes.string_at(host.data_ptr(), host.numel()) if host.numel() else b""
