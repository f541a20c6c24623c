"""The pickle-free codec: exact round trips, clear refusals, no unpickling unless asked."""

from __future__ import annotations

import math
import pathlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.collectives._codec import pack, unpack


def roundtrip(obj: Any, **kwargs: Any) -> Any:
    return unpack(pack(obj, **kwargs), **kwargs)


@pytest.mark.parametrize(
    "value",
    [
        None, True, False, 0, -1, 2**200, -(2**64) - 7, 1.5, -0.0, 1e-320, float("inf"), float("-inf"),
        "", "ascii", "grüße ∑ 日本語 🚀", "lone \ud800 surrogate", "nul\x00inside", b"", b"\x00\xff", bytearray(b"ab"),
        [], [1, "a", None], (1, 2), (), {"a": 1, 2: "b", (3, "k"): [4]}, {1, 2, 3}, frozenset({"x"}),
        ["only", "strings", ""], ["with\x00nul", "x"], [[1, 2], [3, [4, (5,)]]],
    ],
)  # fmt: skip
def test_plain_values_round_trip_exactly(value: Any) -> None:
    back = roundtrip(value)
    assert back == value
    assert type(back) is type(value)
    if isinstance(value, float):
        assert math.copysign(1, back) == math.copysign(1, value)


def test_nan_round_trips() -> None:
    assert math.isnan(roundtrip(float("nan")))
    assert math.isnan(roundtrip([float("nan")])[0])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.tensor([2**62 + 1, -(2**63)], dtype=torch.int64),
        torch.tensor([1 / 3, -0.0, float("nan")], dtype=torch.float64),
        torch.linspace(-3, 3, 7, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        torch.tensor(7.25),
        torch.empty(0, 5, dtype=torch.float16),
        torch.arange(20, dtype=torch.uint8).reshape(4, 5).t(),  # not contiguous
    ],
)
def test_tensors_keep_dtype_shape_and_every_bit(tensor: torch.Tensor) -> None:
    back = roundtrip({"t": tensor})["t"]
    assert back.dtype == tensor.dtype
    assert back.shape == tensor.shape
    assert back.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).contiguous().view(torch.uint8).tolist()


def test_requires_grad_travels_and_data_is_copied_unless_asked() -> None:
    tensor = torch.ones(3, requires_grad=True)
    buffer = pack([tensor, torch.zeros(2)])
    copied = unpack(buffer)
    assert copied[0].requires_grad
    assert copied[1].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    viewed = unpack(buffer, copy=False)
    assert viewed[1].untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(6, dtype=np.int16).reshape(2, 3),
        np.array([1.5, -2.5], dtype=np.float16),
        np.array([65535], dtype=np.uint16),
        np.array(["ab", "cde"]),
        np.array([True, False]),
        np.zeros((0, 3)),
        np.arange(10)[::2],  # not contiguous
    ],
)
def test_numpy_arrays_keep_dtype_and_values(array: np.ndarray) -> None:
    back = roundtrip(array)
    assert back.dtype == array.dtype
    assert np.array_equal(back, array)


def test_numpy_scalars_come_back_as_numpy_scalars() -> None:
    back = roundtrip([np.float32(1.25), np.int64(-3)])
    assert [type(x) for x in back] == [np.float32, np.int64]
    assert back == [1.25, -3]


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5) | st.integers(), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@given(json_like)
def test_any_nested_plain_data_round_trips(value: Any) -> None:
    assert roundtrip(value) == value


class Point:  # a user's own class: not sent without pickle
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x

    def __hash__(self) -> int:
        return self.x


def test_paths_travel_without_pickle_and_keep_their_type() -> None:
    """OML's sync_dicts_ddp pickles lists of paths; here they travel as text, pickle-free."""
    paths = [pathlib.Path("images/1.jpg"), pathlib.PurePosixPath("/data"), pathlib.PureWindowsPath(r"C:\\x\\y.png")]
    back = unpack(pack({"paths": paths, "by_path": {pathlib.Path("k"): 1}}))
    assert back == {"paths": paths, "by_path": {pathlib.Path("k"): 1}}
    assert [type(p) for p in back["paths"]] == [type(p) for p in paths]


def test_other_objects_need_allow_pickle_and_the_error_says_where() -> None:
    with pytest.raises(TypeError, match=r"obj\['a'\]\[1\] is a tests.unit.test_codec.Point, .*allow_pickle=True"):
        pack({"a": [1, Point(2)]})
    with pytest.raises(TypeError, match=r"sparse|layout"):
        pack(torch.eye(2).to_sparse())
    assert roundtrip({"a": [1, Point(2)]}, allow_pickle=True) == {"a": [1, Point(2)]}


class _Exploit:
    """Unpickling this would write a file: the proof that code ran."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "pwned"))  # type: ignore[return-value]


def test_pickled_data_is_never_unpickled_without_consent(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    buffer = pack({"x": _Exploit(str(target))}, allow_pickle=True)  # what a malicious sender could send
    with pytest.raises(pickle.UnpicklingError, match="without allow_pickle=True"):
        unpack(buffer)
    assert not target.exists(), "the payload was executed"


def test_corrupt_or_foreign_buffers_are_refused() -> None:
    buffer = pack({"a": torch.arange(100)})
    with pytest.raises(ValueError, match="not a ddpkit codec buffer"):
        unpack(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="truncated"):
        unpack(buffer[:40])
    with pytest.raises(ValueError, match="not a ddpkit codec buffer"):
        unpack(torch.zeros(4, dtype=torch.float32))
