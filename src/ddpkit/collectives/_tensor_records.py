"""The fast ending of a gather of one tensor per rank (private): every rank's tensor read from the records of
:func:`~ddpkit.collectives._transport.send_records` as views, without decoding a header, when every rank sent a
tensor of the same kind that fits in its record."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import torch

from ddpkit.collectives import _record as record
from ddpkit.collectives._framing import BODY_INLINE, HEAD_INLINE, MAGIC, PREFIX, VERSION, body_offset
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import SIZES, TENSOR_HEADER
from ddpkit.collectives._transport import inline_capacity, send_records
from ddpkit.errors import DDPKitError

__all__ = ["Placement", "gather_tensor_records", "tensor_placements"]

# A record holding a tensor's head, by number of dimensions: the record's prefix, then the head's fields.
_TENSOR_RECORDS = [struct.Struct(PREFIX.format + TENSOR_HEADER.format[1:] + sizes.format[1:]) for sizes in SIZES]


#: Where a rank's tensor lies in the gathered records: its shape, its first byte, its length in bytes.
Placement = tuple[Sequence[int], int, int]


def gather_tensor_records(
    head: bytes, payload: torch.Tensor | None, info: GroupInfo, same_shape: bool
) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Step 1 of ``_transport.exchange`` for a gather of one tensor per rank, with its fast ending.

    Args:
        head: this rank's header (:func:`~ddpkit.collectives._headers.tensor_head` for a tensor; any
            :func:`~ddpkit.collectives._headers.encode_header` otherwise).
        payload: this rank's tensor, or ``None``.
        info: the group, of several ranks.
        same_shape: the fast ending needs every rank's shape to equal this rank's (else only the dtype and
            the number of dimensions).

    Returns:
        ``(gathered, tensors)``: every rank's record (``_transport.read_records`` reads them), and every rank's
        tensor (``payload`` itself for this rank; the others views of ``gathered``, on ``payload``'s device)
        when every rank sent a tensor of ``payload``'s kind that fits in its record (:func:`tensor_placements`),
        else ``None``: the caller reads the records in full, which raises on a mismatch and names it.
    """
    capacity = inline_capacity(info.world_size)
    gathered = torch.empty(info.world_size * capacity, dtype=torch.uint8, device=info.device)
    if payload is None or head[:1] != b"\x01":
        return send_records(head, payload, info, gathered), None
    # Prepared before the collective: right after it, each distinct torch call costs several times its usual
    # time on a busy machine, and what follows it here is struct reads and one view per rank.
    typed = gathered.view(payload.dtype)
    memory = None if info.nccl else record.memory_of(gathered)
    device = payload.device
    send_records(head, payload, info, gathered)
    host = gathered.cpu() if memory is None else gathered  # kept alive while `memory` is read
    placements = tensor_placements(record.memory_of(host) if memory is None else memory, capacity, head, same_shape)
    if placements is None:
        return gathered, None
    if device != info.device:
        typed = typed.to(device)
    itemsize = payload.element_size()
    tensors = []
    for r, (shape, start, nbytes) in enumerate(placements):
        if r == info.rank:
            tensors.append(payload)
            continue
        strides, size = [], 1
        for dim in reversed(shape):
            strides.append(size)
            size *= dim
        if size * itemsize != nbytes:
            raise DDPKitError(f"rank {r} sent {nbytes} bytes for a {payload.dtype} tensor of shape {list(shape)}")
        tensors.append(typed.as_strided(shape, strides[::-1], start // itemsize))
    return gathered, tensors


def tensor_placements(memory: Any, capacity: int, head: bytes, same_shape: bool) -> list[Placement] | None:
    """Every rank's tensor in ``memory`` (every rank's record, :func:`~ddpkit.collectives._record.memory_of`),
    read without decoding headers, when every rank sent a tensor inside its record with the dtype and number
    of dimensions of ``head`` (this rank's ``_headers.tensor_head``), and the same shape too when ``same_shape``;
    else ``None``.

    Every rank holds the same records, so the ranks get ``None`` together or not at all. One ``unpack_from``
    per rank: this runs on every small gather, right after its collective.
    """
    layout = _TENSOR_RECORDS[head[2]]
    expected = (MAGIC, VERSION, HEAD_INLINE | BODY_INLINE, len(head), *TENSOR_HEADER.unpack_from(head))
    own_shape = list(SIZES[head[2]].unpack_from(head, TENSOR_HEADER.size)) if same_shape else None
    start = body_offset(len(head))
    placements: list[Placement] = []
    for offset in range(0, len(memory), capacity):
        magic, version, flags, head_bytes, nbytes, *described = layout.unpack_from(memory, offset)
        shape = described[3:]
        if (magic, version, flags, head_bytes, *described[:3]) != expected or (same_shape and shape != own_shape):
            return None
        placements.append((shape, offset + start, nbytes))
    return placements
