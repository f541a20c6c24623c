"""Pickle-free encoding of nested Python data into one byte buffer.

What travels: ``None``, ``bool``, ``int`` (any size), ``float`` (exactly, NaN and
infinities included), ``str`` (any script), ``bytes``, ``bytearray``, ``list``,
``tuple``, ``set``, ``frozenset``, ``dict`` (any encodable keys), ``pathlib``
paths, numpy arrays and scalars of fixed-size dtypes, and torch tensors (dense,
any dtype). The
tree travels as UTF-8 JSON, the tensor, array and bytes data as raw aligned
bytes after it, so receivers can view it without copying. Anything else raises
``TypeError`` unless ``allow_pickle=True``, and a buffer is never unpickled
unless the receiver also passes ``allow_pickle=True``.

Subclasses of the built-in types (``IntEnum``, ``namedtuple``, ``OrderedDict``)
come back as the built-in type. A ``Path`` comes back as a ``Path`` (a pure path
of the sender's flavour when the receiver runs another operating system), a
``PurePosixPath`` or ``PureWindowsPath`` as itself.

A non-empty list of strings travels as one UTF-8 leaf joined by NUL (split in
C on arrival), unless a string contains NUL.

A buffer is a frame of :mod:`ddpkit.collectives._framing`: the JSON structure is its head,
the leaves (each at a 16-byte boundary) its body.
"""

from __future__ import annotations

import json
import pathlib
import pickle
from typing import Any

import numpy as np
import torch

from ddpkit.collectives._framing import PREFIX, align, body_offset, pack_prefix, unpack_prefix

__all__ = ["dtype_from_name", "dtype_name", "pack", "unpack"]

# The tree's tags: any value that is not a JSON scalar or a list travels as a one-key dict {tag: value}.
# A "leaf" is an index into the body's aligned byte blocks; its byte count follows it.
TENSOR = "T"  # torch tensor: [leaf, dtype name, shape, device type, requires_grad]
ARRAY = "A"  # numpy array: [leaf, dtype name, shape]
NUMPY_SCALAR = "S"  # numpy scalar: [leaf, dtype name]
STRINGS = "U"  # a list of strings: [leaf, bytes], the UTF-8 strings joined by NUL
BYTES = "B"  # bytes: [leaf, bytes]
BYTEARRAY = "b"  # bytearray: [leaf, bytes]
PATH = "p"  # pathlib path: [str, "posix" or "windows", whether a concrete Path]
DICT = "d"  # dict: [[key node, value node], ...]
TUPLE, SET, FROZENSET, LIST = "t", "s", "f", "l"  # [node, ...] (LIST: a list in a subclass)
PICKLED = "P"  # pickle (only with allow_pickle): [leaf, bytes]
_SEQUENCES: dict[str, type[Any]] = {LIST: list, TUPLE: tuple, SET: set, FROZENSET: frozenset}

_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def _all_scalars(items: list[Any]) -> bool:
    """Whether every item is a plain JSON scalar (checked in C: ~30 ns an item)."""
    return set(map(type, items)) <= _SCALAR_TYPES


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the name ddpkit sends and prints for a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The inverse of :func:`dtype_name`.

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def pack(obj: Any, *, allow_pickle: bool = False, device: torch.device | None = None) -> torch.Tensor:
    """Encode ``obj`` into a 1-D ``uint8`` tensor on ``device`` (default CPU).

    Raises:
        TypeError: ``obj`` holds something not listed in the module docstring
            (the message gives its type and where it sits, e.g. ``obj['a'][2]``),
            and ``allow_pickle`` is false.
    """
    leaves: list[torch.Tensor] = []
    tree = _Encoder(leaves, allow_pickle).encode(obj, "obj")
    structure = json.dumps(tree, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    pieces = [_bytes_tensor(structure)]
    offset = PREFIX.size + len(structure)
    for leaf in leaves:
        padding = align(offset) - offset
        if padding:
            pieces.append(torch.zeros(padding, dtype=torch.uint8))
        pieces.append(leaf)
        offset += padding + leaf.numel()
    body = max(0, offset - body_offset(len(structure)))
    pieces.insert(0, _bytes_tensor(pack_prefix(len(structure), body)))
    target = device or torch.device("cpu")
    return torch.cat([piece.to(target) for piece in pieces])


def unpack(
    buffer: torch.Tensor,
    *,
    allow_pickle: bool = False,
    copy: bool = True,
    device: torch.device | None = None,
) -> Any:
    """Decode a buffer made by :func:`pack`.

    Args:
        buffer: 1-D ``uint8`` tensor, on any device.
        allow_pickle: unpickle objects that were pickled by a sender with
            ``allow_pickle=True``; without it such a buffer raises.
        copy: give each tensor and array its own memory (default). ``False``
            returns views into ``buffer``: faster, but every view keeps the whole
            buffer alive and ``torch.save`` of one writes all of it.
        device: where tensors go; default the same device type as on the sender
            (a CUDA tensor lands on this process's current CUDA device, or on the
            CPU where there is none).

    Raises:
        ValueError: the buffer is not a ddpkit codec buffer, or is truncated.
        pickle.UnpicklingError: it holds pickled data and ``allow_pickle`` is false.
    """
    host = buffer.detach().reshape(-1)
    if host.dtype != torch.uint8 or host.numel() < PREFIX.size:
        raise ValueError(f"not a ddpkit codec buffer: {host.dtype} tensor of {host.numel()} elements")
    try:
        _, length, _ = unpack_prefix(bytes(host[: PREFIX.size].cpu().numpy()))
    except ValueError as exc:
        raise ValueError(f"not a ddpkit codec buffer ({exc})") from None
    end = PREFIX.size + length
    if host.numel() < end:
        raise ValueError(f"truncated ddpkit codec buffer: {host.numel()} bytes, structure needs {end}")
    structure = bytes(host[PREFIX.size : end].cpu().numpy()).decode("utf-8", "surrogatepass")
    return _Decoder(host, end, allow_pickle, copy, device).decode(json.loads(structure))


# --- encoding ------------------------------------------------------------------------------


class _Encoder:
    def __init__(self, leaves: list[torch.Tensor], allow_pickle: bool) -> None:
        self.leaves = leaves
        self.allow_pickle = allow_pickle

    def leaf(self, data: torch.Tensor) -> int:
        self.leaves.append(data)
        return len(self.leaves) - 1

    def encode(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind in _SCALARS:
            return obj
        if kind is list:
            types = set(map(type, obj))  # checked in C: ~30 ns an item
            if types == {str}:  # fast path: strings joined by NUL, split in C on arrival
                joined = "\x00".join(obj)
                if joined.count("\x00") == len(obj) - 1:
                    data = joined.encode("utf-8", "surrogatepass")
                    return {STRINGS: [self.leaf(_bytes_tensor(data)), len(data)]}
            if types <= _SCALAR_TYPES:  # fast path: flat lists of scalars travel as JSON
                return obj
            return [self.encode(item, f"{path}[{i}]") for i, item in enumerate(obj)]
        if isinstance(obj, torch.Tensor):
            return {TENSOR: self.tensor(obj, path)}
        if isinstance(obj, np.ndarray):
            return {ARRAY: self.array(obj, path)}
        if isinstance(obj, np.generic):
            return {NUMPY_SCALAR: self.array(np.asarray(obj), path)[:2]}
        if isinstance(obj, (bool, int, float, str)):  # subclasses: IntEnum, str enums, ...
            return _builtin(obj)
        if isinstance(obj, (bytes, bytearray)):
            return {BYTES if isinstance(obj, bytes) else BYTEARRAY: [self.leaf(_bytes_tensor(obj)), len(obj)]}
        if isinstance(obj, pathlib.PurePath):
            windows = isinstance(obj, pathlib.PureWindowsPath)
            return {PATH: [str(obj), "windows" if windows else "posix", isinstance(obj, pathlib.Path)]}
        if isinstance(obj, dict):
            items = [[self.encode(k, f"{path} key {k!r}"), self.encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]
            return {DICT: items}
        for tag, base in _SEQUENCES.items():
            if isinstance(obj, base):
                return {tag: [self.encode(item, f"{path}[{i}]") for i, item in enumerate(obj)]}
        if self.allow_pickle:
            data = pickle.dumps(obj)
            return {PICKLED: [self.leaf(_bytes_tensor(data)), len(data)]}
        raise TypeError(
            f"{path} is a {kind.__module__}.{kind.__qualname__}, which ddpkit does not send without pickle; "
            "send tensors, arrays, numbers, strings, bytes, lists, tuples and dicts, or pass allow_pickle=True "
            "(only between processes you trust)"
        )

    def tensor(self, tensor: torch.Tensor, path: str) -> list[Any]:
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"{path} is a {tensor.layout} tensor; only dense (strided) tensors can be sent")
        data = tensor.detach().contiguous().reshape(-1)
        raw = data.view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8, device=data.device)
        dtype = dtype_name(tensor.dtype)
        return [self.leaf(raw), dtype, list(tensor.shape), tensor.device.type, tensor.requires_grad]

    def array(self, array: np.ndarray, path: str) -> list[Any]:
        dtype = array.dtype
        if dtype.hasobject or np.dtype(dtype.str) != dtype:
            raise TypeError(f"{path} is a numpy array of dtype {dtype}, which ddpkit cannot send as raw bytes")
        contiguous = np.ascontiguousarray(array)
        raw = (
            torch.from_numpy(contiguous.reshape(-1).view(np.uint8))
            if contiguous.size
            else torch.empty(0, dtype=torch.uint8)
        )
        return [self.leaf(raw), dtype.str, list(array.shape)]


def _builtin(obj: bool | int | float | str) -> bool | int | float | str:
    for base in (bool, int, float, str):
        if isinstance(obj, base):
            return base(obj)
    raise AssertionError(obj)  # pragma: no cover


def _bytes_tensor(data: bytes | bytearray) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


# --- decoding ------------------------------------------------------------------------------


class _Decoder:
    def __init__(
        self, buffer: torch.Tensor, start: int, allow_pickle: bool, copy: bool, device: torch.device | None
    ) -> None:
        self.buffer = buffer
        self.offsets: list[int] = []
        self.cursor = start
        self.allow_pickle = allow_pickle
        self.copy = copy
        self.device = device

    def take(self, index: int, nbytes: int) -> torch.Tensor:
        """The bytes of leaf ``index`` (leaves are decoded in the order they were encoded)."""
        if index != len(self.offsets):
            raise ValueError(f"corrupt ddpkit codec buffer: leaf {index} out of order")
        start = align(self.cursor)
        end = start + nbytes
        if end > self.buffer.numel():
            raise ValueError(f"truncated ddpkit codec buffer: {self.buffer.numel()} bytes, leaf {index} needs {end}")
        self.offsets.append(start)
        self.cursor = end
        return self.buffer[start:end]

    def decode(self, node: Any) -> Any:
        if isinstance(node, list):
            if _all_scalars(node):
                return node
            return [self.decode(item) for item in node]
        if not isinstance(node, dict):
            return node
        ((tag, value),) = node.items()
        if tag == TENSOR:
            return self.tensor(*value)
        if tag == ARRAY:
            return self.array(*value)
        if tag == NUMPY_SCALAR:
            return self.array(value[0], value[1], [])[()]
        if tag == STRINGS:
            return bytes(self.take(*value).cpu().numpy()).decode("utf-8", "surrogatepass").split("\x00")
        if tag in (BYTES, BYTEARRAY):
            raw = bytes(self.take(*value).cpu().numpy())
            return raw if tag == BYTES else bytearray(raw)
        if tag == DICT:
            return {_hashable(self.decode(k)): self.decode(v) for k, v in value}
        if tag == PATH:
            return _path(*value)
        if tag == PICKLED:
            if not self.allow_pickle:
                raise pickle.UnpicklingError(
                    "this data was pickled by the sender; refusing to unpickle it without allow_pickle=True"
                )
            return pickle.loads(bytes(self.take(*value).cpu().numpy()))
        builder = _SEQUENCES.get(tag)
        if builder is None:
            raise ValueError(f"corrupt ddpkit codec buffer: unknown tag {tag!r}")
        items = [self.decode(item) for item in value]
        return builder(_hashable(i) for i in items) if builder in (set, frozenset) else builder(items)

    def tensor(self, index: int, name: str, shape: list[int], device_type: str, requires_grad: bool) -> torch.Tensor:
        try:
            dtype = dtype_from_name(name)
        except ValueError as exc:
            raise ValueError(f"corrupt ddpkit codec buffer: {exc}") from None
        numel = 1
        for size in shape:
            numel *= size
        raw = self.take(index, numel * dtype.itemsize)
        result = raw.view(dtype).reshape(shape) if numel else torch.empty(shape, dtype=dtype, device=raw.device)
        result = result.to(self.target(device_type))
        if self.copy and result.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr():
            result = result.clone()
        return result.requires_grad_(requires_grad) if requires_grad and result.is_floating_point() else result

    def array(self, index: int, dtype_str: str, shape: list[int]) -> np.ndarray:
        dtype = np.dtype(dtype_str)
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        raw = self.take(index, size * dtype.itemsize).cpu().numpy()
        result = raw.view(dtype).reshape(shape) if size else np.empty(shape, dtype=dtype)
        return result.copy() if self.copy else result

    def target(self, device_type: str) -> torch.device:
        if self.device is not None:
            return self.device
        if device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _path(text: str, flavour: str, concrete: bool) -> pathlib.PurePath:
    """A path as the sender had it: a ``Path`` when it was one and this OS has its flavour, else a pure path."""
    pure = pathlib.PureWindowsPath if flavour == "windows" else pathlib.PurePosixPath
    if concrete and isinstance(pathlib.Path(), pure):
        return pathlib.Path(text)
    return pure(text)


def _hashable(value: Any) -> Any:
    """Dict keys and set items that decoded to lists (never the case for valid data) are rejected clearly."""
    if isinstance(value, (list, dict, set)):
        raise ValueError(f"corrupt ddpkit codec buffer: unhashable key {value!r}")
    return value
