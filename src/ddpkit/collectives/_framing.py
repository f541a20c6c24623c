"""The one byte format ddpkit sends: a 16-byte prefix, a head, then a body at a 16-byte boundary.

Both the codec's buffers (:mod:`ddpkit.collectives._codec`: the head is the JSON structure,
the body the tensors', arrays' and bytes' raw data) and the fixed record every
gather starts with (:mod:`ddpkit.collectives._record`: the head is the
metadata, the body the payload when it fits) are frames:

==========================  ======  ==================================================
offset                      bytes   field
==========================  ======  ==================================================
0                           2       magic ``b"DK"``
2                           1       version (1)
3                           1       flags (the record's: 1 the head is inline, 2 the body)
4                           4       head length in bytes (little-endian)
8                           8       body length in bytes (little-endian)
16                          head    the head
``align(16 + head)``        body    the body (every part of it 16-byte aligned, so
                                    any dtype can view it in place)
==========================  ======  ==================================================
"""

from __future__ import annotations

import struct

__all__ = [
    "ALIGNMENT",
    "BODY_INLINE",
    "HEAD_INLINE",
    "MAGIC",
    "PREFIX",
    "VERSION",
    "align",
    "body_offset",
    "pack_prefix",
    "unpack_prefix",
]

#: Every part of a body starts at a multiple of this many bytes.
ALIGNMENT = 16
#: The prefix: magic, version, flags, head length, body length (16 bytes).
PREFIX = struct.Struct("<2sBBIQ")
#: Flags of a gather's record: its head, or its body, is in the record itself.
HEAD_INLINE, BODY_INLINE = 1, 2
#: The first two bytes of every frame, and the format's version (its third byte).
MAGIC, VERSION = b"DK", 1


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGNMENT`."""
    return -(-n // ALIGNMENT) * ALIGNMENT


def body_offset(head_length: int) -> int:
    """Where the body starts in a frame whose head has ``head_length`` bytes."""
    return align(PREFIX.size + head_length)


def pack_prefix(head_length: int, body_length: int, flags: int = 0) -> bytes:
    """The 16 prefix bytes of a frame."""
    return PREFIX.pack(MAGIC, VERSION, flags, head_length, body_length)


def unpack_prefix(data: bytes | memoryview | bytearray, offset: int = 0) -> tuple[int, int, int]:
    """``(flags, head length, body length)`` of the frame starting at ``offset``.

    Raises:
        ValueError: the bytes there are not a ddpkit frame (wrong magic or version).
    """
    magic, version, flags, head_length, body_length = PREFIX.unpack_from(data, offset)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a ddpkit frame (magic {bytes(magic)!r}, version {version})")
    return flags, head_length, body_length
