"""Gather several named values from every rank and join them: one exchange per call.

Used by ``mp_sync``, ``mp_sync_dict`` and ``sync_dicts_ddp`` (aitoolbox's
``mp_sync_dict`` runs one gather per key; OML pickles every tensor).

Small data travels inside the metadata exchange. For large data every rank
knows every size after that exchange, so each large tensor or array key gets
its final, concatenated buffer up front and each rank's part is broadcast
straight into its slice (the sender sends from its own tensor): no packing
copy, no concatenation copy. Lists of objects and small keys share one packed
blob per rank. On NCCL the blobs go through one padded ``all_gather``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.collectives._codec import dtype_from_name, dtype_name, pack, unpack
from ddpkit.collectives._framing import align
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import Header, error_header
from ddpkit.collectives._transport import exchange, exchange_headers
from ddpkit.errors import CollectiveMismatchError

__all__ = ["Gathered", "KeyMeta", "Value", "gather_values"]

Kind = Literal["tensor", "array", "objects"]
# A tensor or array key whose bytes over all ranks reach this is broadcast straight into its final buffer.
_DIRECT = 1 << 20


@dataclass(frozen=True)
class Value:
    """One value to gather: a tensor, a numpy array, or a list of plain objects.

    Attributes:
        data: the value itself.
        source: what the caller passed ("tensor", "ndarray", "list", "tuple",
            "scalar", ...), compared across ranks and used to convert back.
        extra: more metadata compared across ranks (e.g. the element type).
    """

    data: torch.Tensor | np.ndarray | list[Any]
    source: str
    extra: str = ""


@dataclass(frozen=True)
class KeyMeta:
    """What one rank says about one key's value; compared across ranks before any data moves.

    Attributes:
        source: :attr:`Value.source`.
        extra: :attr:`Value.extra`.
        kind: ``"tensor"``, ``"array"`` or ``"objects"`` (a list, through the codec).
        dtype: the tensor's dtype (``"float32"``) or the array's (``"<f4"``); ``""`` for objects.
        shape: the tensor's or array's shape; ``(items,)`` for objects.
        nbytes: the bytes this rank sends for it.
    """

    source: str
    extra: str
    kind: Kind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def to_wire(self) -> list[Any]:
        """The meta as JSON-able data (in a gather's header)."""
        return [self.source, self.extra, self.kind, self.dtype, list(self.shape), self.nbytes]

    @staticmethod
    def from_wire(data: list[Any]) -> KeyMeta:
        source, extra, kind, dtype, shape, nbytes = data
        return KeyMeta(source, extra, kind, dtype, tuple(shape), nbytes)

    def signature(self) -> tuple[Any, ...]:
        """What must match across ranks: all but the first dimension may differ."""
        if self.kind == "objects":
            return ("objects", self.source, self.extra)
        return (self.kind, self.source, self.extra, self.dtype, len(self.shape), self.shape[1:])

    def text(self) -> str:
        if self.kind == "objects":
            return f"{self.source} of {self.shape[0]} objects"
        extra = f" of {self.extra}" if self.extra else ""
        return f"{self.source}{extra} ({self.kind}) {self.dtype} {self.shape}"


@dataclass
class Gathered:
    """Every rank's values of each key, and their concatenation along the first dimension.

    ``parts[key]`` holds one value per rank (tensors as views, possibly into
    ``joined[key]``); ``joined[key]`` is the concatenation (a tensor or array on
    the communication device, or a list), computed on first use.
    """

    parts: dict[Any, list[Any]]
    joined: dict[Any, Any] = field(default_factory=dict)

    def join(self, key: Any) -> Any:
        if key not in self.joined:
            parts = self.parts[key]
            if isinstance(parts[0], torch.Tensor):
                device = parts[-1].device
                self.joined[key] = torch.cat([p.to(device) for p in parts])
            elif isinstance(parts[0], np.ndarray):
                self.joined[key] = np.concatenate(parts)
            else:
                self.joined[key] = [item for part in parts for item in part]
        return self.joined[key]


def gather_values(
    what: str,
    values: dict[Any, Value] | BaseException,
    group: dist.ProcessGroup | None,
    *,
    allow_pickle: bool = False,
) -> Gathered:
    """Every rank's ``{key: value}``; every rank must call it.

    Keys must be the same on every rank, and each key's kind, source, dtype and
    trailing dimensions (all but the first) too; the first dimension may differ.
    Pass the exception instead of ``values`` when this rank's input is bad:
    every rank then raises it.

    Raises:
        CollectiveMismatchError: keys or per-key metadata differ between ranks.
        TypeError, ValueError: some rank's input was bad, or a list holds objects
            that need ``allow_pickle=True``.
    """
    info = GroupInfo.of(group)
    rank = info.rank
    try:
        if isinstance(values, BaseException):
            raise values
        metas, raws = _describe_values(values, allow_pickle)
        header: Header = {"keys": list(values), "values": [meta.to_wire() for meta in metas]}
    except (TypeError, ValueError) as exc:
        header, raws, values = error_header(exc), [], {}

    check = functools.partial(_check, what)
    # Small data rides in the metadata exchange; each rank says whether its data did.
    header["inline"] = sum(r.numel() for r in raws) <= 4096
    every_key = range(len(raws))
    inline = _pack_blob(raws, every_key) if header["inline"] else None
    headers, inline_payloads, _ = exchange_headers(what, header, inline, info, check)
    keys = list(headers[0]["keys"])
    metas_by_rank = [[KeyMeta.from_wire(m) for m in h["values"]] for h in headers]

    direct: dict[int, torch.Tensor] = {}
    pending: list[Any] = []
    blob_keys: list[int] = list(every_key) if keys else []
    if all(h["inline"] for h in headers) and all(p is not None for p in inline_payloads):
        blobs = list(inline_payloads)
    elif info.nccl:
        gathered = exchange(what, {}, _pack_blob(raws, every_key), info)
        blobs = [data for _, data in gathered]
    else:
        blob_keys = _blob_keys(metas_by_rank)
        blobs, direct, pending = _move_large(metas_by_rank, raws, blob_keys, info)
        _fill_own_parts(direct, metas_by_rank, raws, rank)
    offsets = [_offsets(metas, blob_keys) for metas in metas_by_rank]

    parts: dict[Any, list[Any]] = {key: [] for key in keys}
    joined: dict[Any, Any] = {}
    # Objects and blob keys first: decoding them overlaps the pending direct broadcasts.
    order = sorted(range(len(keys)), key=lambda i: i in direct)
    for index in order:
        key = keys[index]
        if index in direct:
            while pending:
                pending.pop().wait()
            joined[key] = _view(direct[index], [m[index] for m in metas_by_rank])
        offset = 0
        for r, metas in enumerate(metas_by_rank):
            meta = metas[index]
            if index in direct:
                data = direct[index][offset : offset + meta.nbytes]
                offset += meta.nbytes
            elif r == rank and isinstance(values, dict):
                parts[key].append(values[key].data)  # this rank's own value: no round trip
                continue
            else:
                blob = blobs[r]
                assert blob is not None
                start = offsets[r][index]
                data = blob[start : start + meta.nbytes]
            parts[key].append(_decode(meta, data, allow_pickle))
    return Gathered(parts, joined)


# --- describing and packing --------------------------------------------------------------------


def _describe_values(values: dict[Any, Value], allow_pickle: bool) -> tuple[list[KeyMeta], list[torch.Tensor]]:
    """Per key: its metadata, and the raw bytes this rank sends."""
    metas, raws = [], []
    for key, value in values.items():
        if not isinstance(key, (str, int, float, bool, type(None))):
            raise TypeError(f"keys must be strings or numbers, got {type(key).__name__} {key!r}")
        data = value.data
        kind: Kind
        if isinstance(data, torch.Tensor):
            kind, dtype, shape = "tensor", dtype_name(data.dtype), tuple(data.shape)
            flat = data.detach().contiguous().reshape(-1)
            raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=flat.device)
        elif isinstance(data, np.ndarray):
            if data.dtype.hasobject or np.dtype(data.dtype.str) != data.dtype:
                raise TypeError(f"numpy arrays of dtype {data.dtype} (key {key!r}) cannot be sent as raw bytes")
            kind, dtype, shape = "array", data.dtype.str, tuple(data.shape)
            flat_array = np.ascontiguousarray(data).reshape(-1)
            raw = torch.from_numpy(flat_array.view(np.uint8)) if flat_array.size else torch.empty(0, dtype=torch.uint8)
        else:
            kind, dtype, shape = "objects", "", (len(data),)
            raw = pack(list(data), allow_pickle=allow_pickle)
        metas.append(KeyMeta(value.source, value.extra, kind, dtype, shape, raw.numel()))
        raws.append(raw)
    return metas, raws


def _offsets(metas: list[KeyMeta], keys: list[int]) -> dict[int, int]:
    """Where each of ``keys`` starts in a rank's blob: one after the other, each at a 16-byte boundary."""
    offsets, offset = {}, 0
    for i in keys:
        offset = align(offset)
        offsets[i] = offset
        offset += metas[i].nbytes
    return offsets


def _pack_blob(raws: list[torch.Tensor], indices: Any) -> torch.Tensor | None:
    """The raws at ``indices`` laid out at the offsets of :func:`_offsets`."""
    chosen = [(i, raws[i]) for i in indices]
    if not chosen:
        return None
    device = next((r.device for _, r in chosen if r.device.type != "cpu"), torch.device("cpu"))
    pieces: list[torch.Tensor] = []
    offset = 0
    for _, raw in chosen:
        padding = align(offset) - offset
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.uint8, device=device))
        pieces.append(raw.to(device))
        offset += padding + raw.numel()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _blob_keys(metas_by_rank: list[list[KeyMeta]]) -> list[int]:
    """The keys that travel in the blobs: objects, and tensors and arrays below the direct threshold."""
    count = len(metas_by_rank[0])
    return [i for i in range(count) if metas_by_rank[0][i].kind == "objects" or
            sum(m[i].nbytes for m in metas_by_rank) < _DIRECT]  # fmt: skip


def _move_large(
    metas_by_rank: list[list[KeyMeta]], raws: list[torch.Tensor], blob_keys: list[int], info: GroupInfo
) -> tuple[list[torch.Tensor | None], dict[int, torch.Tensor], list[Any]]:
    """gloo: large tensor and array keys straight into their joined buffers, the others in one blob per rank.

    Returns the blobs (received), the joined buffers of the direct keys, and the
    pending broadcasts that fill those buffers (wait for them before use).
    """
    device, rank, group = info.device, info.rank, info.group
    direct_keys = [i for i in range(len(metas_by_rank[0])) if i not in blob_keys]
    blob_sizes = []
    for metas in metas_by_rank:  # every rank computes the same sizes from the headers
        offsets = _offsets(metas, blob_keys)
        blob_sizes.append(max((offsets[i] + metas[i].nbytes for i in blob_keys), default=0))
    direct = {i: torch.empty(sum(m[i].nbytes for m in metas_by_rank), dtype=torch.uint8, device=device)
              for i in direct_keys}  # fmt: skip
    blobs: list[torch.Tensor | None] = []
    blob_works = []
    for r in range(len(metas_by_rank)):  # the blobs first: they are decoded while the rest arrives
        if blob_sizes[r]:
            blob = _pack_blob(raws, blob_keys) if r == rank else None
            blob = blob.to(device) if blob is not None else torch.empty(blob_sizes[r], dtype=torch.uint8, device=device)
            blob_works.append(dist.broadcast(blob, src=info.global_rank(r), group=group, async_op=True))
            blobs.append(blob)
        else:
            blobs.append(None)
    direct_works = []
    for r in range(len(metas_by_rank)):
        for i in direct_keys:
            start = sum(m[i].nbytes for m in metas_by_rank[:r])
            size = metas_by_rank[r][i].nbytes
            if size:
                target = raws[i].to(device) if r == rank else direct[i][start : start + size]
                direct_works.append(dist.broadcast(target, src=info.global_rank(r), group=group, async_op=True))
    for work in blob_works:
        work.wait()
    return blobs, direct, direct_works


def _fill_own_parts(
    direct: dict[int, torch.Tensor], metas_by_rank: list[list[KeyMeta]], raws: list[torch.Tensor], rank: int
) -> None:
    """Copy this rank's own part of each direct key into its slice (while the others' parts arrive)."""
    for i, buffer in direct.items():
        start = sum(m[i].nbytes for m in metas_by_rank[:rank])
        buffer[start : start + raws[i].numel()].copy_(raws[i])


# --- checking and decoding ------------------------------------------------------------------------


def header_text(header: Header) -> str:
    """What a rank passed, from its header: a value's (:meth:`KeyMeta.text`), or a tensor's sent alone by a
    gather's fast path (``mp_sync`` of a tensor), in the same words."""
    if "keys" not in header:
        return f"tensor (tensor) {header['dtype']} {tuple(header['shape'])}"
    return "; ".join(KeyMeta.from_wire(value).text() for value in header["values"])


def _check(what: str, headers: list[Header]) -> None:
    first = headers[0]
    if any("keys" not in h for h in headers):  # a rank sent a tensor alone (mp_sync's fast path), another not
        raise CollectiveMismatchError(
            f"{what}: ranks passed incompatible values (kind, dtype and all but the first dimension must match): "
            + "; ".join(f"rank {r}: {header_text(h)}" for r, h in enumerate(headers))
        )
    if any(h["keys"] != first["keys"] for h in headers):
        raise CollectiveMismatchError(
            f"{what}: ranks passed different keys: "
            + "; ".join(f"rank {r}: {h['keys']}" for r, h in enumerate(headers))
        )
    for index, key in enumerate(first["keys"]):
        metas = [KeyMeta.from_wire(h["values"][index]) for h in headers]
        if len({m.signature() for m in metas}) > 1:
            label = "" if key is None and len(first["keys"]) == 1 else f" for key {key!r}"
            raise CollectiveMismatchError(
                f"{what}: ranks passed incompatible values{label} (kind, dtype and all but the first dimension "
                "must match): " + "; ".join(f"rank {r}: {m.text()}" for r, m in enumerate(metas))
            )


def _decode(meta: KeyMeta, data: torch.Tensor, allow_pickle: bool) -> Any:
    if meta.kind == "objects":
        return unpack(data, allow_pickle=allow_pickle, copy=False)
    return _view(data, [meta])


def _view(data: torch.Tensor, metas: list[KeyMeta]) -> Any:
    """``data`` (raw bytes) seen as the tensor or array that ``metas`` describe, joined along dim 0."""
    meta = metas[0]
    shape = list(meta.shape)
    if shape:
        shape[0] = sum(m.shape[0] for m in metas)
    if meta.kind == "tensor":
        dtype = dtype_from_name(meta.dtype)
        return data.view(dtype).reshape(shape) if data.numel() else torch.empty(shape, dtype=dtype, device=data.device)
    np_dtype = np.dtype(meta.dtype)
    host = data.cpu().numpy()
    return host.view(np_dtype).reshape(shape) if host.size else np.empty(shape, dtype=np_dtype)
