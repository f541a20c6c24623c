"""Move one small header and one byte payload per rank, without hangs (private).

Every gather in ddpkit goes through :func:`exchange`:

1. One ``all_gather`` of a fixed-size record per rank (the same size on every
   rank, so it cannot mismatch; its bytes: :mod:`ddpkit.collectives._record`;
   on gloo an ``all_to_all`` of a copy to each rank, which is faster there):
   the rank's header (metadata: kind, dtype, shape, keys...) and, when it fits,
   the payload itself. Small payloads cost this one collective.
2. Every rank now knows every header and every size. The caller's check runs on
   identical data on every rank, so a mismatch raises on every rank at the same
   point, and the process group stays usable.
3. Only what did not fit moves next, with sizes known to all: one ``broadcast``
   per rank on gloo (2-3x faster than gloo's ``all_gather`` for large data, and
   only the real bytes move), or a padded ``all_gather`` on NCCL and for small
   totals (on gloo, an ``all_to_all`` of a padded copy per rank).

A rank whose own input is bad sends an error header instead of data, so every
rank raises together instead of leaving the others waiting.

The code between collectives is kept to few torch calls: right after a
blocking collective each distinct one costs several times its usual time on a
busy machine (measured on 2 ranks sharing 2 cores: the first torch call after
the collective 8-10 us, the same call again 3.5 us, 0.3 us warm). So a gather of
one small tensor per rank (``_tensor_records``) prepares its views
before the collective and after it reads every record with one
``struct.unpack_from`` and makes one view per other rank; the records are those
of step 1, so when they are not all alike, step 2 reads the same bytes in full.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddpkit.collectives import _record as record
from ddpkit.collectives._framing import align
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import Header, decode_header, encode_header, raise_errors

__all__ = [
    "Check",
    "Records",
    "as_bytes",
    "broadcast_bytes",
    "exchange",
    "exchange_headers",
    "exchange_rest",
    "inline_capacity",
    "read_records",
    "send_records",
]

Check = Callable[[list[Header]], None]

# Below this many bytes in all, a padded all_gather beats one broadcast per rank on gloo.
_SMALL_TOTAL = 1 << 20
_EMPTY = torch.empty(0, dtype=torch.uint8)


def inline_capacity(world_size: int) -> int:
    """Bytes of the fixed record each rank sends first: 64 KiB shared by the ranks, 1-4 KiB each."""
    return max(1024, min(4096, (65536 // max(1, world_size)) // 16 * 16))


def as_bytes(payload: torch.Tensor | None) -> torch.Tensor:
    """``payload``'s raw bytes as a 1-D ``uint8`` tensor (a view when it is contiguous)."""
    if payload is None or payload.numel() == 0:
        return _EMPTY if payload is None or payload.device.type == "cpu" else _EMPTY.to(payload.device)
    flat = payload.detach()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.reshape(-1).view(torch.uint8)


class Records(NamedTuple):
    """Every rank's record once the first step of :func:`exchange` is done and the headers are checked.

    Attributes:
        headers: every rank's header, in rank order.
        views: what every rank's record says, in rank order.
        buffer: every rank's record, ``(world_size * capacity,)`` ``uint8`` on the group's device.
        capacity: one record's size in bytes.
    """

    headers: list[Header]
    views: list[record.RecordView]
    buffer: torch.Tensor
    capacity: int

    def inline_payload(self, rank: int) -> torch.Tensor | None:
        """Rank ``rank``'s payload bytes (a 1-D ``uint8`` view of :attr:`buffer`), or ``None`` when it did not
        fit in its record."""
        view = self.views[rank]
        if not view.payload_inline:
            return None
        start = rank * self.capacity + view.payload_offset
        return self.buffer[start : start + view.payload_bytes]


def send_records(
    head: bytes, payload: torch.Tensor | None, info: GroupInfo, gathered: torch.Tensor | None = None
) -> torch.Tensor:
    """Step 1 of :func:`exchange` in a group of several ranks: every rank's record on every rank (one ``all_gather``;
    on gloo one ``all_to_all``).

    Returns:
        ``gathered`` (allocated when not given): ``(world_size * capacity,)`` ``uint8`` on the group's
        device, rank ``r``'s record at ``r * inline_capacity(world_size)``.
    """
    nbytes = payload.numel() * payload.element_size() if payload is not None else 0
    capacity = inline_capacity(info.world_size)
    sent = record.write(head, payload, nbytes, capacity, info.world_size if info.gloo else 1)
    if gathered is None:
        gathered = torch.empty(info.world_size * capacity, dtype=torch.uint8, device=info.device)
    _all_gather_flat(gathered, sent.to(info.device) if info.nccl else sent, info)
    return gathered


def read_records(what: str, head: bytes, gathered: torch.Tensor, info: GroupInfo, check: Check | None) -> Records:
    """Step 2 of :func:`exchange`: every rank's header from ``gathered`` (:func:`send_records`; headers too
    large for their record move now), then the error headers and ``check``.

    Raises:
        TypeError, ValueError, DDPKitError: some rank sent an error header; whatever ``check`` raises.
    """
    capacity = inline_capacity(info.world_size)
    views = record.read_all(gathered, capacity, decode_header)
    headers = [view.header for view in views]
    missing = [0 if view.header is not None else align(view.header_bytes) for view in views]
    if any(missing):  # some header did not fit in the record: move the headers alone
        padded = head + bytes(align(len(head)) - len(head)) if missing[info.rank] else b""
        mine = torch.frombuffer(bytearray(padded), dtype=torch.uint8).to(info.device) if padded else _EMPTY
        for r, blob in enumerate(_uneven_gather(mine, missing, info)):
            if headers[r] is None:
                assert blob is not None
                headers[r] = decode_header(record.host_bytes(blob)[: views[r].header_bytes])
    complete = [h for h in headers if h is not None]
    raise_errors(what, complete)
    if check is not None:
        check(complete)
    return Records(complete, views, gathered, capacity)


def exchange_headers(
    what: str, header: Header, payload: torch.Tensor | None, info: GroupInfo, check: Check | None = None
) -> tuple[list[Header], list[torch.Tensor | None], list[int]]:
    """Steps 1 and 2 of :func:`exchange`: every header, and the payloads that fit in the fixed record.

    Returns:
        ``(headers, payloads, sizes)`` in rank order: a payload is 1-D ``uint8``,
        or ``None`` when it did not fit (its ``sizes`` entry says how many bytes
        it has); this rank's own entry is ``payload`` as given (not its bytes).
    """
    if info.alone:
        raise_errors(what, [header])
        if check is not None:
            check([header])
        return [header], [payload], [payload.numel() * payload.element_size() if payload is not None else 0]
    head = encode_header(header)
    records = read_records(what, head, send_records(head, payload, info), info, check)
    payloads = [
        None if not view.payload_inline else payload if r == info.rank else records.inline_payload(r)
        for r, view in enumerate(records.views)
    ]
    return records.headers, payloads, [view.payload_bytes for view in records.views]


def exchange(
    what: str,
    header: Header,
    payload: torch.Tensor | None,
    info: GroupInfo,
    check: Check | None = None,
) -> list[tuple[Header, torch.Tensor]]:
    """All-gather ``(header, payload)`` from every rank of the group; every rank must call it.

    Args:
        what: the public function's name, for error messages.
        header: small JSON-able metadata of this rank's payload.
        payload: any tensor, sent as its raw bytes; ``None`` sends nothing.
        info: the process group (:meth:`~ddpkit.collectives._group_info.GroupInfo.of`).
        check: called with every rank's header on every rank before any large
            data moves; raise there (e.g. :class:`~ddpkit.CollectiveMismatchError`)
            to fail on every rank together.

    Returns:
        ``[(header, payload)]`` in rank order: other ranks' payloads as 1-D
        ``uint8`` on the group's communication device; this rank's own entry is
        ``payload`` as given (an empty tensor for ``None``).

    Raises:
        TypeError, ValueError, DDPKitError: some rank sent an error header (see
            :func:`~ddpkit.collectives._headers.raise_errors`); whatever ``check`` raises.
    """
    headers, payloads, sizes = exchange_headers(what, header, payload, info, check)
    return list(zip(headers, exchange_rest(payload, payloads, sizes, info), strict=True))


def exchange_rest(
    payload: torch.Tensor | None, payloads: list[torch.Tensor | None], sizes: list[int], info: GroupInfo
) -> list[torch.Tensor]:
    """Step 3 of :func:`exchange`: move the payloads that did not fit in their records (``None`` in
    ``payloads``, ``sizes`` bytes each); every rank's payload, this rank's ``payload`` as given (empty for
    ``None``)."""
    missing = [size if received is None else 0 for received, size in zip(payloads, sizes, strict=True)]
    if any(missing):
        mine = as_bytes(payload).to(info.device) if missing[info.rank] else _EMPTY
        for r, blob in enumerate(_uneven_gather(mine, missing, info)):
            if payloads[r] is None:
                payloads[r] = payload if r == info.rank else blob
    return [p if p is not None else _EMPTY for p in payloads]


def broadcast_bytes(
    what: str, header: Header, payload: torch.Tensor | None, src: int, info: GroupInfo
) -> tuple[Header, torch.Tensor]:
    """Broadcast ``(header, payload)`` from global rank ``src``; other ranks' arguments are ignored.

    One ``broadcast`` of the fixed record when the payload fits in it, else two
    (or three, for a header too large for the record). Every rank of the group
    must call it.

    Raises:
        TypeError, ValueError, DDPKitError: ``src`` sent an error header.
    """
    data = as_bytes(payload)
    nbytes = data.numel()
    if info.alone:
        raise_errors(what, [header])
        return header, data
    capacity = inline_capacity(info.world_size)
    is_src = dist.get_rank() == src
    head = encode_header(header) if is_src else b""
    if is_src:
        sent = record.write(head, data, nbytes, capacity).to(info.device)
    else:
        sent = torch.empty(capacity, dtype=torch.uint8, device=info.device)
    dist.broadcast(sent, src=src, group=info.group)
    (view,) = record.read_all(sent, capacity, decode_header)
    received = view.header
    if received is None:
        if is_src:
            blob = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(info.device)
        else:
            blob = torch.empty(view.header_bytes, dtype=torch.uint8, device=info.device)
        dist.broadcast(blob, src=src, group=info.group)
        received = decode_header(record.host_bytes(blob))
    raise_errors(what, [received])
    if view.payload_inline:
        start = view.payload_offset
        return received, data if is_src else sent[start : start + view.payload_bytes]
    buffer = data.to(info.device) if is_src else torch.empty(view.payload_bytes, dtype=torch.uint8, device=info.device)
    if view.payload_bytes:
        dist.broadcast(buffer, src=src, group=info.group)
    return received, data if is_src else buffer


# --- moving uneven data ------------------------------------------------------------------------


def _all_gather_flat(output: torch.Tensor, sent: torch.Tensor, info: GroupInfo) -> None:
    """Every rank's ``sent`` into ``output`` (``world_size`` times its size), in rank order.

    On gloo ``sent`` holds ``world_size`` copies of this rank's bytes, and one ``all_to_all`` hands each rank
    its copy (gloo's ``all_to_all`` of a few KiB to 512 KiB a rank took 0.45-0.76x its ``all_gather``'s time
    on 2 ranks, about 0.6x on 3 and 4); elsewhere ``sent`` is the bytes once, and it is one ``all_gather``.
    """
    if info.gloo:
        dist.all_to_all_single(output, sent, group=info.group)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(output, sent, group=info.group)


def _uneven_gather(mine: torch.Tensor, sizes: list[int], info: GroupInfo) -> list[torch.Tensor | None]:
    """Every rank's blob (``sizes[r]`` bytes; ``None`` where 0); sizes are known to all ranks."""
    world_size, rank, device = len(sizes), info.rank, info.device
    largest = align(max(sizes))  # keep every row aligned, so any dtype can view it
    if info.nccl or largest * world_size <= _SMALL_TOTAL:
        copies = world_size if info.gloo else 1
        padded = torch.zeros(copies, largest, dtype=torch.uint8, device=device)
        padded[:, : sizes[rank]] = mine
        output = torch.empty(world_size * largest, dtype=torch.uint8, device=device)
        _all_gather_flat(output, padded.view(-1), info)
        rows = output.view(world_size, largest)
        return [rows[r, : sizes[r]] if sizes[r] else None for r in range(world_size)]
    blobs: list[torch.Tensor | None] = []
    for r, size in enumerate(sizes):
        if not size:
            blobs.append(None)
            continue
        blob = mine if r == rank else torch.empty(size, dtype=torch.uint8, device=device)
        dist.broadcast(blob, src=info.global_rank(r), group=info.group)
        blobs.append(blob)
    return blobs
