"""Reduce a tensor over ranks: Lightning's ``sync_ddp`` and ``sync_ddp_if_available``.

Ranks that pass different shapes, dtypes or ops to a raw ``all_reduce`` get
silent garbage on one rank and a hang on the other (measured on gloo). Every
call here starts with the same collective on every rank, so none can mismatch:

1. A probe: ``all_reduce`` (sum) of one float64: this rank's value when it
   reduces one element with ``sum`` or ``mean`` and the value is exact in
   float64, else NaN. A sum that is not NaN is the answer: a scalar metric costs
   one one-element ``all_reduce``, as a raw one does, and a write into the
   input. (Eligible ranks that differ in dtype or sum-vs-mean each get what they
   asked for; a NaN value merely takes the next step, which gives NaN too.)
2. Otherwise a check: ``all_reduce`` of a fixed-size float64 vector holding a
   signature of (dtype, shape, op), twice (CRC-32 and Adler-32), in the terms of
   :mod:`ddpkit.collectives.agreement`. Small ``sum``/``mean`` payloads ride along.
3. Otherwise the native ``all_reduce`` of the payload, in its own dtype.

Every rank decides from the same reduced numbers, so all take the same path,
and a mismatch raises :class:`~ddpkit.CollectiveMismatchError` on every rank.
"""

from __future__ import annotations

import math
import threading
import zlib
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ddpkit.collectives._codec import dtype_name
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import error_header, raise_errors
from ddpkit.collectives._transport import exchange
from ddpkit.collectives.agreement import all_equal, signature_terms
from ddpkit.errors import CollectiveMismatchError

__all__ = ["ReduceOpName", "sync_ddp", "sync_ddp_if_available"]

ReduceOpName = Literal["sum", "mean", "max", "min", "prod", "band", "bor", "bxor"]

_NAMES: dict[str, ReduceOpName] = {
    "sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min", "prod": "prod", "product": "prod",
}  # fmt: skip
_REDUCE_OPS: list[tuple[object, ReduceOpName]] = [
    (ReduceOp.SUM, "sum"), (ReduceOp.AVG, "mean"), (ReduceOp.MAX, "max"), (ReduceOp.MIN, "min"),
    (ReduceOp.PRODUCT, "prod"), (ReduceOp.BAND, "band"), (ReduceOp.BOR, "bor"), (ReduceOp.BXOR, "bxor"),
]  # fmt: skip
_NATIVE = {
    "sum": ReduceOp.SUM, "mean": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN, "prod": ReduceOp.PRODUCT,
    "band": ReduceOp.BAND, "bor": ReduceOp.BOR, "bxor": ReduceOp.BXOR,
}  # fmt: skip
# The check vector's slots (float64, summed over the ranks):
_NO_INPUT = 0  # 1 on a rank without a tensor to reduce: any > 0 total fails the check
_CRC, _ADLER = 1, 3  # two slots each: a signature of (dtype, shape, op) and its square (all_equal checks them)
_NOT_INLINE = 5  # 1 on a rank whose payload does not ride along in the check: any > 0 takes the native path
_CHECK = 6  # the slots before the payload
# Elements of a sum/mean payload that ride along in the check vector (2 KiB of float64).
_INLINE = 256
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def sync_ddp(
    result: torch.Tensor | float | int | bool,
    group: dist.ProcessGroup | None = None,
    reduce_op: ReduceOp | str | None = None,
) -> torch.Tensor:
    """Reduce ``result`` over the ranks of ``group`` in place, as Lightning's ``sync_ddp``; every rank must call it.

    Args:
        result: a tensor of any shape, or a number (``int`` becomes int64, or
            the default float dtype for a mean; ``float`` float64; ``bool`` bool).
        group: the process group; default the whole world.
        reduce_op: ``"sum"`` (default), ``"mean"`` or ``"avg"``, ``"max"``,
            ``"min"``, ``"prod"``, or a ``torch.distributed.ReduceOp`` (``AVG``
            means mean; ``BAND``, ``BOR``, ``BXOR`` for integer tensors).

    Returns:
        ``result`` itself, holding the reduced values (as Lightning's: ``result
        is sync_ddp(result)``, so ``sync_ddp(t); use(t)`` uses the reduced
        values), or a new tensor when ``result`` is a number. The dtype is kept:
        the mean of an integer tensor is truncated toward zero, as Lightning's
        (pass a floating-point tensor for an exact mean). The write-back does not
        enter the autograd graph. Without a process group: ``result`` unchanged
        (the reduction over one rank).

    Raises:
        ValueError: an unknown ``reduce_op`` (the message lists the valid ones), on
            every rank, with or without a process group.
        CollectiveMismatchError: ranks passed different shapes, dtypes or ops; raised
            on every rank, naming each rank's input.
        TypeError: some rank passed something that is not a tensor or a number.
    """
    op = _resolve_op(reduce_op)
    info = GroupInfo.of(group)
    if info.alone:  # no group, or a group of one: the reduction over one rank is the value itself
        return _as_tensor(result, op)
    tensor: torch.Tensor | None = None
    problem: TypeError | None = None
    try:
        tensor = _as_tensor(result, op)
    except TypeError as exc:
        problem = exc  # every rank must still take part, to raise together
    return _reduce(tensor, problem, op, info)


def sync_ddp_if_available(
    result: torch.Tensor | float | int | bool,
    group: dist.ProcessGroup | None = None,
    reduce_op: ReduceOp | str | None = None,
) -> torch.Tensor:
    """:func:`sync_ddp` when a process group exists, else ``result`` unchanged (Lightning's ``sync_ddp_if_available``).

    Identical to :func:`sync_ddp`, which also works without a process group; kept
    for code written against Lightning's name.
    """
    return sync_ddp(result, group=group, reduce_op=reduce_op)


def _resolve_op(reduce_op: ReduceOp | str | None) -> ReduceOpName:
    if reduce_op is None:
        return "sum"
    if isinstance(reduce_op, str):
        name = _NAMES.get(reduce_op.strip().lower())
        if name is not None:
            return name
    else:
        for candidate, name in _REDUCE_OPS:
            if reduce_op == candidate:
                return name
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported; use 'sum', 'mean' (or 'avg'), 'max', 'min', 'prod', or "
        "torch.distributed.ReduceOp.SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR"
    )


def _as_tensor(result: object, op: ReduceOpName = "sum") -> torch.Tensor:
    if isinstance(result, torch.Tensor):
        return result
    if op == "mean" and isinstance(result, int):  # no tensor of the caller's to hold it: the exact mean
        return torch.tensor(result, dtype=torch.get_default_dtype())
    if isinstance(result, bool):
        return torch.tensor(result, dtype=torch.bool)
    if isinstance(result, int):
        return torch.tensor(result, dtype=torch.int64)
    if isinstance(result, float):
        return torch.tensor(result, dtype=torch.float64)
    raise TypeError(f"sync_ddp reduces a tensor or a number, got {type(result).__name__}")


def _describe(tensor: torch.Tensor, op: str) -> str:
    return f"{dtype_name(tensor.dtype)} {tuple(tensor.shape)} {op}"


def _reduce(tensor: torch.Tensor | None, problem: TypeError | None, op: ReduceOpName, info: GroupInfo) -> torch.Tensor:
    world_size, device, group = info.world_size, info.device, info.group

    # 1. The probe: one float64 on every rank (NaN from a rank that cannot take this path). Few torch calls:
    # each costs several times its usual time right after a collective here.
    scalar = tensor is not None and op in ("sum", "mean") and tensor.numel() == 1 and _fits_float64(tensor, world_size)
    probe = _probe(device).fill_(tensor.item() if scalar and tensor is not None else math.nan)
    dist.all_reduce(probe, op=ReduceOp.SUM, group=group)
    total = probe.item()
    if not math.isnan(total):
        assert tensor is not None
        value = total / world_size if op == "mean" else total
        if not tensor.requires_grad:
            return tensor.fill_(value)
        with torch.no_grad():
            return tensor.fill_(value)

    # 2. The check, with small sum/mean payloads riding along.
    vector = torch.zeros(_CHECK + _INLINE, dtype=torch.float64)
    rides_along = False
    if tensor is None:
        vector[_NO_INPUT] = 1.0
    else:
        rides_along = op in ("sum", "mean") and _fits_float64(tensor, world_size)
        text = _describe(tensor, op).encode()
        for slot, signature in ((_CRC, zlib.crc32(text)), (_ADLER, zlib.adler32(text))):
            vector[slot], vector[slot + 1] = signature_terms(signature, world_size)
        vector[_NOT_INLINE] = 0.0 if rides_along else 1.0
        if rides_along:
            vector[_CHECK : _CHECK + tensor.numel()] = tensor.detach().reshape(-1).to("cpu", torch.float64)
    vector = vector.to(device)
    dist.all_reduce(vector, op=ReduceOp.SUM, group=group)
    totals = vector[:_CHECK].cpu().tolist()

    agree = all(all_equal(totals[slot], totals[slot + 1], world_size) for slot in (_CRC, _ADLER))
    if totals[_NO_INPUT] or not agree:
        # Every rank saw the same totals, so every rank is here: tell them what each passed.
        if problem is not None:
            header = error_header(problem)
        else:
            header = {"desc": _describe(tensor, op) if tensor is not None else "nothing"}
        headers = [h for h, _ in exchange("sync_ddp", header, None, info)]
        raise_errors("sync_ddp", headers)
        raise CollectiveMismatchError(
            "sync_ddp: ranks passed incompatible inputs (dtype, shape and op must match): "
            + "; ".join(f"rank {r}: {h['desc']}" for r, h in enumerate(headers))
        )
    assert tensor is not None
    with torch.no_grad():
        if not totals[_NOT_INLINE]:  # every rank's payload rode along: the float64 sums are exact
            summed = vector[_CHECK : _CHECK + tensor.numel()].reshape(tensor.shape)
            return tensor.copy_(summed / world_size if op == "mean" else summed)

        # 3. Native, in the payload's own dtype (shapes and dtypes are known to match), in place when it can be.
        direct = tensor.is_contiguous() and tensor.device == device
        native = tensor if direct else tensor.contiguous().to(device, copy=True)
        dist.all_reduce(native, op=_NATIVE[op], group=group)
        if op == "mean":
            exact = native.is_floating_point() or native.is_complex()
            native = native.div_(world_size) if exact else native / world_size
        return tensor if native is tensor else tensor.copy_(native)


_PROBES = threading.local()  # this thread's probe tensor per device (filling one costs less than making one)


def _probe(device: torch.device) -> torch.Tensor:
    """This thread's one-element float64 probe on ``device``, made once (its value is overwritten at each use)."""
    probes: dict[torch.device, torch.Tensor] = getattr(_PROBES, "by_device", None) or {}
    _PROBES.by_device = probes
    if device not in probes:
        probes[device] = torch.zeros((), dtype=torch.float64, device=device)
    return probes[device]


def _fits_float64(tensor: torch.Tensor, world_size: int) -> bool:
    """Whether a sum over ``world_size`` ranks is exact in float64 and within ``tensor``'s dtype."""
    if tensor.numel() > _INLINE:
        return False
    if tensor.dtype in _FLOATS:
        return True
    if tensor.dtype == torch.bool:
        return True
    if tensor.dtype.is_complex or tensor.dtype.is_floating_point:
        return False
    limit = min(2**53, torch.iinfo(tensor.dtype).max) // world_size
    return tensor.numel() == 0 or int(tensor.detach().abs().max()) <= limit
