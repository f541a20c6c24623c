"""A rank's header (what it sends: kind, dtype, shape, keys...) as bytes, and the error header a rank sends instead of
bad input (private): a compact binary form for a tensor's dtype and shape, JSON otherwise."""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch

from ddpkit.collectives import _record as record
from ddpkit.collectives._codec import dtype_name
from ddpkit.errors import DDPKitError

__all__ = [
    "SIZES",
    "TENSOR_HEADER",
    "Header",
    "decode_header",
    "encode_header",
    "error_header",
    "raise_errors",
    "tensor_head",
]

Header = record.Header

_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)  # fmt: skip
_DTYPE_NAMES = [dtype_name(dtype) for dtype in _DTYPES]
_DTYPE_CODES = {name: code for code, name in enumerate(_DTYPE_NAMES)}
_CODE_OF_DTYPE = {dtype: code for code, dtype in enumerate(_DTYPES)}
TENSOR_HEADER = struct.Struct("<BBB")  # form (1 = tensor), dtype code, number of dimensions; then int64 sizes
SIZES = [struct.Struct(f"<{ndim}q") for ndim in range(17)]


def tensor_head(tensor: torch.Tensor) -> bytes | None:
    """:func:`encode_header` of ``{"dtype": ..., "shape": ...}`` for ``tensor``, without the dict; ``None`` for a
    dtype or a number of dimensions that the compact form does not hold."""
    code, shape = _CODE_OF_DTYPE.get(tensor.dtype), tensor.shape
    if code is None or len(shape) > 16:
        return None
    return TENSOR_HEADER.pack(1, code, len(shape)) + SIZES[len(shape)].pack(*shape)


def encode_header(header: Header) -> bytes:
    """A header's bytes: a compact binary form for tensor descriptors (``dtype``, ``shape``), JSON otherwise."""
    if header.keys() == {"dtype", "shape"} and header["dtype"] in _DTYPE_CODES and len(header["shape"]) <= 16:
        shape = header["shape"]
        return TENSOR_HEADER.pack(1, _DTYPE_CODES[header["dtype"]], len(shape)) + SIZES[len(shape)].pack(*shape)
    return b"\x00" + json.dumps(header, separators=(",", ":")).encode()


def decode_header(data: bytes) -> Header:
    """The inverse of :func:`encode_header`."""
    if data[:1] == b"\x01":
        _, code, ndim = TENSOR_HEADER.unpack_from(data)
        return {"dtype": _DTYPE_NAMES[code], "shape": list(SIZES[ndim].unpack_from(data, 3))}
    header: Header = json.loads(data[1:])
    return header


def error_header(exc: BaseException) -> Header:
    """The header a rank sends instead of its data when its own input is bad."""
    return {"error": [type(exc).__name__, str(exc)]}


def raise_errors(what: str, headers: Sequence[Header]) -> None:
    """Raise on every rank if any rank sent an error header.

    The exception is a ``TypeError`` or ``ValueError`` when the first failing rank
    raised one (so ``except TypeError`` works on every rank), else a
    :class:`~ddpkit.DDPKitError`; its message names every failing rank.
    """
    failures = [(rank, header["error"]) for rank, header in enumerate(headers) if "error" in header]
    if not failures:
        return
    kind = {"TypeError": TypeError, "ValueError": ValueError}.get(failures[0][1][0], DDPKitError)
    raise kind(f"{what}: " + "; ".join(f"rank {rank}: {message}" for rank, (_, message) in failures))
