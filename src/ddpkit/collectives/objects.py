"""Gather and broadcast plain Python objects without pickling them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit.collectives._codec import pack, unpack
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import Header, error_header
from ddpkit.collectives._transport import broadcast_bytes, exchange

__all__ = ["all_gather_object", "broadcast_object"]


def all_gather_object(obj: Any, group: dist.ProcessGroup | None = None, *, allow_pickle: bool = False) -> list[Any]:
    """Gather one object from every rank of ``group`` onto every rank; every rank must call it.

    Unlike ``torch.distributed.all_gather_object``, nothing is pickled: tensors
    travel as their raw bytes, and ``None``, ``bool``, ``int`` (any size),
    ``float`` (exact), ``str`` (UTF-8, any script), ``bytes``, ``list``,
    ``tuple``, ``set``, ``dict`` and numpy arrays through ddpkit's own encoding of plain data.
    Ranks may pass objects of different types and sizes. Small objects cost one
    ``all_gather``.

    Args:
        obj: this rank's object.
        group: the process group; default the whole world.
        allow_pickle: pickle (and unpickle) what the codec cannot send, such as
            instances of your own classes. Unpickling runs code chosen by the
            sender: use it only between processes you trust.

    Returns:
        ``[object of rank 0, object of rank 1, ...]``; tensors come back on the
        device type they were sent from (CUDA: this process's current device).
        This rank's entry is ``obj`` itself. Without a process group: ``[obj]``.

    Raises:
        TypeError: some rank's object holds something the codec cannot send and
            ``allow_pickle`` is false (raised on every rank, naming the rank and
            where the object sits).
    """
    info = GroupInfo.of(group)
    payload, header = _encode(obj, allow_pickle, info.device)
    gathered = exchange("all_gather_object", header, payload, info)
    return [obj if r == info.rank else unpack(data, allow_pickle=allow_pickle) for r, (_, data) in enumerate(gathered)]


def broadcast_object(
    obj: Any, src: int = 0, group: dist.ProcessGroup | None = None, *, allow_pickle: bool = False
) -> Any:
    """Send ``obj`` from rank ``src`` to every rank of ``group``; every rank must call it.

    What travels, and how, as in :func:`all_gather_object`. One ``broadcast``
    when the object is small, two otherwise.

    Args:
        obj: the object on rank ``src``; ignored on the other ranks (pass ``None``).
        src: global rank of the sender (as in ``torch.distributed.broadcast``).
        group: the process group; default the whole world.
        allow_pickle: as in :func:`all_gather_object`.

    Returns:
        The object, on every rank (on ``src``: ``obj`` itself). Without a process
        group: ``obj``.

    Raises:
        TypeError: the object cannot be sent without ``allow_pickle`` (every rank).
    """
    info = GroupInfo.of(group)
    if not info.distributed:
        return obj
    is_src = dist.get_rank() == src
    payload, header = _encode(obj, allow_pickle, info.device) if is_src else (None, {})
    _, data = broadcast_bytes("broadcast_object", header, payload, src, info)
    return obj if is_src else unpack(data, allow_pickle=allow_pickle)


def _encode(obj: Any, allow_pickle: bool, device: torch.device) -> tuple[torch.Tensor | None, Header]:
    try:
        return pack(obj, allow_pickle=allow_pickle, device=device), {}
    except TypeError as exc:
        return None, error_header(exc)
