"""Sync data and dicts across ranks: aitoolbox's ``mp_sync`` and ``mp_sync_dict``, OML's ``sync_dicts_ddp``."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.collectives._codec import dtype_name
from ddpkit.collectives._headers import Header
from ddpkit.collectives.gather import gather_tensors
from ddpkit.collectives.values import Gathered, Value, gather_values, header_text
from ddpkit.errors import CollectiveMismatchError, WarningDDP
from ddpkit.process_group import get_world_size, is_distributed

__all__ = ["merge_list_of_dicts", "mp_sync", "mp_sync_dict", "sync_dicts_ddp"]


def mp_sync(
    data: torch.Tensor | np.ndarray | list[Any] | tuple[Any, ...] | float | int | bool,
    double_precision: bool = False,
    concat_mp_data: bool = True,
    return_tensor: bool = True,
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Share ``data`` between all processes, so that each has every process's values (aitoolbox's ``mp_sync``).

    Every rank must call it. Lengths (the first dimension) may differ between
    ranks; the kind of data, its dtype and other dimensions may not.

    Args:
        data: a tensor (any dtype, kept exactly; device preserved), a numpy array,
            a list or tuple of numbers, a single number (treated as a one-element
            list), or a list of strings or other plain objects (gathered as
            lists). Numbers and arrays are wrapped as aitoolbox's
            ``torch.tensor(data)`` wraps them: bools stay bool, ints become
            int64, floats the default float dtype (float32), arrays keep their
            dtype.
        double_precision: make every wrapped (non-tensor) input float64: numbers,
            bools and numpy arrays alike, as aitoolbox's ``.double()``.
        concat_mp_data: concatenate the ranks' data along the first dimension
            (a scalar becomes one element per rank); otherwise return one entry per rank.
        return_tensor: return tensors; otherwise a numpy array for a numpy array
            and a list for anything else (tuples too, as aitoolbox's ``tolist()``);
            a tensor input stays a tensor. Lists of strings and other objects
            always come back as lists.
        group: the process group; default the whole world.

    Returns:
        With ``concat_mp_data``: ``(sum of lengths, *rest)`` in rank order;
        otherwise a list of ``world_size`` entries. Without a process group: the
        same as with one rank.

    Raises:
        CollectiveMismatchError: kinds, dtypes or trailing dimensions differ
            between ranks (on every rank, naming each rank's value).
        TypeError: ``data`` is of an unsupported type (on every rank).
    """
    try:
        value = _mp_value(data, double_precision)
    except TypeError as exc:
        gather_values("mp_sync", exc, group)
        raise  # not reached: gather_values raised it on every rank
    data_tensor = value.data if value.source == "tensor" and isinstance(value.data, torch.Tensor) else None
    if data_tensor is not None and data_tensor.layout == torch.strided and is_distributed():
        # A tensor alone: the gathers' own exchange, whose small tensors end after one collective. Its first
        # collective is the same as the general one's, so a rank that passed another kind makes both raise.
        tensors = gather_tensors(data_tensor, group, "mp_sync", False, _tensor_check)
        trailing = data_tensor.shape[1:]  # the fast ending checked the dtypes and numbers of dimensions
        if any(t.shape[1:] != trailing for t in tensors):
            _tensor_check([{"dtype": dtype_name(t.dtype), "shape": list(t.shape)} for t in tensors])
        return torch.cat(tensors) if concat_mp_data else [t.clone() for t in tensors]
    gathered = gather_values("mp_sync", {None: value}, group)
    return _combine(value, gathered, None, concat_mp_data, return_tensor)


def _tensor_check(headers: list[Header]) -> None:
    """``mp_sync`` of tensors: every rank's a tensor of one dtype and the same dimensions but the first."""
    if all("keys" not in h for h in headers):
        first = headers[0]
        if all(h["dtype"] == first["dtype"] and len(h["shape"]) == len(first["shape"]) and h["shape"][1:] ==
               first["shape"][1:] for h in headers):  # fmt: skip
            return
    raise CollectiveMismatchError(
        "mp_sync: ranks passed incompatible values (kind, dtype and all but the first dimension must match): "
        + "; ".join(f"rank {r}: {header_text(h)}" for r, h in enumerate(headers))
    )


def mp_sync_dict(dict_data: dict[Any, Any], group: dist.ProcessGroup | None = None) -> dict[Any, Any]:
    """:func:`mp_sync` of every value of ``dict_data``, in one exchange (aitoolbox's ``mp_sync_dict``).

    Every rank must call it with the same keys. Defaults as :func:`mp_sync`:
    values concatenated over ranks, returned as tensors (lists of strings as lists).

    Returns:
        ``{key: synced value}``.

    Raises:
        CollectiveMismatchError: keys, or a value's kind, dtype or trailing
            dimensions, differ between ranks.
        TypeError: a value of an unsupported type.
    """
    try:
        values: dict[Any, Value] | BaseException = {k: _mp_value(v, False) for k, v in dict_data.items()}
    except TypeError as exc:
        values = exc
    gathered = gather_values("mp_sync_dict", values, group)
    assert isinstance(values, dict)
    return {key: _combine(value, gathered, key, True, True) for key, value in values.items()}


def merge_list_of_dicts(list_of_dicts: Sequence[dict[str, Any]], device: torch.device | str = "cpu") -> dict[str, Any]:
    """Merge dicts key by key (OML's ``merge_list_of_dicts``): lists and tuples chained, tensors and arrays joined.

    Args:
        list_of_dicts: dicts with the same keys, each key's values of the same type.
        device: where concatenated tensors go.

    Returns:
        ``{key: merged}``: a list or tuple (the first dict's type) chaining all
        values, ``torch.cat(..., dim=0)`` on ``device``, or ``np.concatenate(..., axis=0)``.

    Raises:
        ValueError: the dicts' keys or value types differ (the message names them).
        TypeError: a value is not a list, tuple, tensor or numpy array.
    """
    if not list_of_dicts:
        return {}
    first = list_of_dicts[0]
    for index, item in enumerate(list_of_dicts):
        for key, value in item.items():
            if not isinstance(value, (list, tuple, torch.Tensor, np.ndarray)):
                raise TypeError(
                    f"only lists, tuples, tensors and numpy arrays can be merged; got {type(value).__name__} "
                    f"for key {key!r} in dict {index}"
                )
        mine = {(k, type(v)) for k, v in item.items()}
        theirs = {(k, type(v)) for k, v in first.items()}
        if mine != theirs:
            raise ValueError(
                f"dicts must have the same keys with the same types of values; dict 0 has "
                f"{_key_types(first)}, dict {index} has {_key_types(item)}"
            )
    merged: dict[str, Any] = {}
    for key, sample in first.items():
        parts = [item[key] for item in list_of_dicts]
        if isinstance(sample, (list, tuple)):
            merged[key] = type(sample)(itertools.chain.from_iterable(parts))
        elif isinstance(sample, torch.Tensor):
            merged[key] = torch.cat([part.to(device) for part in parts], dim=0)
        else:
            merged[key] = np.concatenate(parts, axis=0)
    return merged


def sync_dicts_ddp(
    outputs_from_device: dict[str, Any],
    world_size: int,
    device: torch.device | str = "cpu",
    *,
    allow_pickle: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Combine every rank's dict of results into one merged dict on every rank (OML's ``sync_dicts_ddp``).

    Every rank must call it with the same keys. Values: lists and tuples
    (chained in rank order), tensors (concatenated along dim 0 on ``device``),
    numpy arrays (concatenated along axis 0). Unlike OML, nothing is pickled:
    tensors and arrays travel as raw bytes, the whole dict in one exchange, and
    list items through ddpkit's own encoding of plain data (strings, numbers, ``pathlib`` paths,
    nested lists and dicts of them, ...). Other objects in lists need
    ``allow_pickle=True``, which OML implies.

    Args:
        outputs_from_device: this rank's results.
        world_size: the number of processes, as in OML; it must equal the
            process group's size.
        device: where the concatenated tensors go.
        allow_pickle: pickle list items the codec cannot send (trusted peers only).
        group: the process group; default the whole world.

    Returns:
        The merged dict. Without a process group: ``outputs_from_device``
        unchanged, with a :class:`~ddpkit.WarningDDP` if ``world_size > 1``.

    Raises:
        CollectiveMismatchError: keys or value kinds, dtypes or trailing
            dimensions differ between ranks (on every rank).
        TypeError: a value is not a list, tuple, tensor or array (on every rank).
        ValueError: ``world_size`` is not the process group's size (on every rank).
    """
    if not is_distributed():
        if world_size > 1:
            warnings.warn(sync_dicts_ddp.__name__, WarningDDP, stacklevel=2)
        return outputs_from_device
    values: dict[Any, Value] | BaseException
    try:
        if world_size != get_world_size(group):
            raise ValueError(f"world_size={world_size} but the process group has {get_world_size(group)} ranks")
        values = {key: _dict_value(key, value) for key, value in outputs_from_device.items()}
    except (TypeError, ValueError) as exc:
        values = exc
    gathered = gather_values("sync_dicts_ddp", values, group, allow_pickle=allow_pickle)
    assert isinstance(values, dict)
    merged: dict[str, Any] = {}
    for key, value in values.items():
        joined = gathered.join(key)
        if value.source == "tensor":
            merged[key] = joined.to(device)
        elif value.source == "ndarray":
            merged[key] = joined
        else:
            merged[key] = tuple(joined) if value.source == "tuple" else joined
    return merged


# --- helpers ------------------------------------------------------------------------------------


def _mp_value(data: Any, double_precision: bool) -> Value:
    """``data`` wrapped as aitoolbox's ``mp_sync`` wraps it (``torch.tensor(data)``, ``.double()`` if asked)."""
    if isinstance(data, torch.Tensor):
        return Value(data.reshape(1) if data.dim() == 0 else data, "tensor")
    if isinstance(data, np.ndarray):
        array = data.reshape(1) if data.ndim == 0 else data
        return Value(array.astype(np.float64) if double_precision else array, "ndarray")
    if isinstance(data, np.generic):
        wrapped = torch.from_numpy(np.asarray([data]))
        return Value(wrapped.double() if double_precision else wrapped, "list")
    if isinstance(data, (bool, int, float, list, tuple)):
        items = list(data) if isinstance(data, (list, tuple)) else [data]
    else:
        raise TypeError(f"mp_sync syncs tensors, numpy arrays, lists, tuples and numbers, got {type(data).__name__}")
    element = _element_type(items)
    if element is None:
        return Value(items, "list")
    dtype = torch.float64 if double_precision else _WRAPPED_DTYPES.get(element, torch.get_default_dtype())
    return Value(torch.tensor(items, dtype=dtype), "list")


#: What ``torch.tensor`` makes of Python numbers: bool, int64, or the default float dtype.
_WRAPPED_DTYPES = {"bool": torch.bool, "int": torch.int64}


def _element_type(items: list[Any]) -> str | None:
    """ "int", "float" or "bool" for (nested, rectangular) lists of numbers; None for anything else."""
    flat: list[Any] = items
    while flat and all(isinstance(i, (list, tuple)) for i in flat):
        if len({len(i) for i in flat}) > 1:
            return None
        flat = [x for i in flat for x in i]
    if not flat or not all(isinstance(x, (bool, int, float)) for x in flat):
        return "float" if not flat and items == [] else None
    if all(isinstance(x, bool) for x in flat):
        return "bool"
    return "int" if all(isinstance(x, int) for x in flat) else "float"


def _combine(value: Value, gathered: Gathered, key: Any, concat: bool, return_tensor: bool) -> Any:
    """Concatenate or list the ranks' data of ``key`` and convert it as ``mp_sync`` documents."""
    if isinstance(value.data, list):
        return gathered.join(key) if concat else [list(p) for p in gathered.parts[key]]
    if isinstance(value.data, np.ndarray):
        if concat:
            joined = np.array(gathered.join(key))
            return torch.from_numpy(joined) if return_tensor else joined
        arrays = [np.array(p) for p in gathered.parts[key]]
        return [torch.from_numpy(a) for a in arrays] if return_tensor else arrays
    device = value.data.device
    out: Any = (
        gathered.join(key).to(device, copy=True) if concat else [p.to(device, copy=True) for p in gathered.parts[key]]
    )
    if return_tensor or value.source == "tensor":
        return out
    return out.tolist() if concat else [t.tolist() for t in out]


def _dict_value(key: Any, value: Any) -> Value:
    if isinstance(value, torch.Tensor):
        return Value(value, "tensor")
    if isinstance(value, np.ndarray):
        return Value(value, "ndarray")
    if isinstance(value, (list, tuple)):
        return Value(list(value), type(value).__name__)
    raise TypeError(
        f"only lists, tuples, tensors and numpy arrays can be merged; got {type(value).__name__} for key {key!r}"
    )


def _key_types(item: dict[str, Any]) -> str:
    return ", ".join(f"{k!r}: {type(v).__name__}" for k, v in item.items())
