"""Object and dict sync: all_gather_object, broadcast_object, aitoolbox's mp_sync, OML's sync_dicts_ddp.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_object_sync.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddpkit import (
    CollectiveMismatchError,
    all_gather_object,
    broadcast_object,
    merge_list_of_dicts,
    mp_sync,
    mp_sync_dict,
    sync_dicts_ddp,
)
from ddpkit.testing import run_parallel

WORLD_SIZES = [2, 3]


def rank_object(rank: int) -> Any:
    return (
        [
            {"rank": rank, "big": 2**100 + rank, "third": 1 / 3 + rank, "text": "ünï 文字 🚀" * rank},
            (b"\x00" * rank, None, True),
            torch.arange(rank + 1, dtype=torch.int64),
            np.full((rank, 2), rank, dtype=np.float16),
        ][rank % 4]
        if rank < 4
        else None
    )


def _gather_objects() -> list[bool]:
    gathered = all_gather_object(rank_object(dist.get_rank()))
    return [_same(g, rank_object(r)) for r, g in enumerate(gathered)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_object_sends_different_objects_exactly(world_size: int) -> None:
    assert run_parallel(_gather_objects, world_size=world_size) == [[True] * world_size] * world_size


class Opaque:  # a user's class: the codec refuses it unless allow_pickle
    def __init__(self, value: int) -> None:
        self.value = value


def _bad_object(allow_pickle: bool) -> tuple[str, str] | list[int]:
    obj: Any = Opaque(dist.get_rank()) if dist.get_rank() == 1 else "fine"
    try:
        gathered = all_gather_object(obj, allow_pickle=allow_pickle)
    except TypeError as exc:
        return "TypeError", str(exc)
    return [g.value if isinstance(g, Opaque) else -1 for g in gathered]


def test_unsendable_objects_raise_on_every_rank_unless_pickle_is_allowed() -> None:
    for name, message in run_parallel(_bad_object, False):
        assert name == "TypeError"
        assert "rank 1: obj is a tests.ranks.test_object_sync.Opaque" in message
    assert run_parallel(_bad_object, True) == [[-1, 1], [-1, 1]]


def _broadcast(size: int, src: int) -> tuple[int, str]:
    obj = {"data": list(range(size)), "from": "ранг"} if dist.get_rank() == src else None
    received = broadcast_object(obj, src=src)
    return len(received["data"]), received["from"]


@pytest.mark.parametrize("size", [3, 50000])  # inline and not
def test_broadcast_object_from_any_rank(size: int) -> None:
    assert run_parallel(_broadcast, size, 2, world_size=3) == [(size, "ранг")] * 3


def _broadcast_bad() -> str:
    try:
        broadcast_object(Opaque(1) if dist.get_rank() == 0 else None)
    except TypeError as exc:
        return str(exc)
    return ""


def test_broadcast_object_refusal_reaches_every_rank() -> None:
    assert all("rank 0: obj is a tests.ranks.test_object_sync.Opaque" in m for m in run_parallel(_broadcast_bad))


# --- aitoolbox's mp_sync --------------------------------------------------------------------------------


def _mp(kind: str, **options: Any) -> Any:
    rank = dist.get_rank()
    data: Any = {
        "tensor": torch.arange(rank + 1, dtype=torch.int64) + 10 * rank,
        "f64": torch.tensor([0.1 + rank], dtype=torch.float64),
        "array": np.arange(rank + 1, dtype=np.float64) / 3,
        "floats": [0.1 * (rank + 1)] * (rank + 1),
        "ints": [2**40 + rank],
        "bools": [rank == 0, True],
        "scalar": 0.5 + rank,
        "strings": [f"path/{rank}/{i}.jpg" for i in range(rank + 1)],
        "tuple": (rank, rank),
        "matrix": torch.ones(rank + 1, 3) * rank,
        "int_array": np.arange(rank + 1, dtype=np.int64) + rank,
    }[kind]
    result = mp_sync(data, **options)
    if isinstance(result, torch.Tensor):
        return "tensor", str(result.dtype), result.tolist()
    if isinstance(result, np.ndarray):
        return "ndarray", str(result.dtype), result.tolist()
    if isinstance(result, list) and result and isinstance(result[0], torch.Tensor):
        return "tensors", [t.tolist() for t in result]
    return type(result).__name__, result


def test_mp_sync_concatenates_uneven_lengths_in_rank_order_with_exact_dtypes() -> None:
    results = run_parallel(_mp, "tensor", world_size=3)
    assert results[2] == ("tensor", "torch.int64", [0, 10, 11, 20, 21, 22])
    assert run_parallel(_mp, "f64")[0] == ("tensor", "torch.float64", [0.1, 1.1])
    assert run_parallel(_mp, "array")[0] == ("tensor", "torch.float64", [0.0, 0.0, 1 / 3])
    assert run_parallel(_mp, "matrix")[1][2] == [[0.0] * 3, [1.0] * 3, [1.0] * 3]


def test_mp_sync_wraps_python_data_as_aitoolbox_does() -> None:
    """aitoolbox wraps with ``torch.tensor(data)`` (dtype inferred) and applies ``.double()`` to any wrapped input."""
    assert run_parallel(_mp, "floats")[0][:2] == ("tensor", "torch.float32")
    doubles = run_parallel(_mp, "floats", double_precision=True)[0]
    assert doubles == ("tensor", "torch.float64", [0.1, 0.2, 0.2])
    assert run_parallel(_mp, "ints")[0] == ("tensor", "torch.int64", [2**40, 2**40 + 1])
    assert run_parallel(_mp, "scalar")[0] == ("tensor", "torch.float32", [0.5, 1.5])
    assert run_parallel(_mp, "bools")[0] == ("tensor", "torch.bool", [True, True, False, True])
    assert run_parallel(_mp, "bools", double_precision=True)[0] == ("tensor", "torch.float64", [1.0, 1.0, 0.0, 1.0])
    assert run_parallel(_mp, "ints", double_precision=True)[0] == ("tensor", "torch.float64", [2.0**40, 2.0**40 + 1])
    assert run_parallel(_mp, "int_array", double_precision=True)[0] == ("tensor", "torch.float64", [0.0, 1.0, 2.0])
    assert run_parallel(_mp, "int_array")[0] == ("tensor", "torch.int64", [0, 1, 2])
    assert run_parallel(_mp, "tensor", double_precision=True)[0][1] == "torch.int64", "a tensor is never converted"


def test_mp_sync_return_tensor_false_gives_back_the_input_type() -> None:
    assert run_parallel(_mp, "floats", return_tensor=False, double_precision=True)[0] == ("list", [0.1, 0.2, 0.2])
    assert run_parallel(_mp, "bools", return_tensor=False)[0] == ("list", [True, True, False, True])
    assert run_parallel(_mp, "tuple", return_tensor=False)[0] == ("list", [0, 0, 1, 1]), "aitoolbox: tolist()"
    assert run_parallel(_mp, "array", return_tensor=False)[0] == ("ndarray", "float64", [0.0, 0.0, 1 / 3])
    assert run_parallel(_mp, "tensor", return_tensor=False)[0][0] == "tensor", "a tensor stays a tensor"


def test_mp_sync_without_concatenation_gives_one_entry_per_rank() -> None:
    assert run_parallel(_mp, "tensor", concat_mp_data=False)[1] == ("tensors", [[0], [10, 11]])
    assert run_parallel(_mp, "scalar", concat_mp_data=False, return_tensor=False)[0] == ("list", [[0.5], [1.5]])


def test_mp_sync_syncs_lists_of_strings() -> None:
    """aitoolbox's mp_sync_dict cannot sync a list of strings at all."""
    assert run_parallel(_mp, "strings", world_size=3)[0] == (
        "list", ["path/0/0.jpg", "path/1/0.jpg", "path/1/1.jpg", "path/2/0.jpg", "path/2/1.jpg", "path/2/2.jpg"]
    )  # fmt: skip


def _mp_mismatch(kind: str) -> str:
    rank = dist.get_rank()
    data: Any = {
        "kind": torch.ones(2) if rank == 0 else np.ones(2),
        "dtype": torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64),
        "trailing": torch.ones(2, 3 if rank == 0 else 4),
        "type": torch.ones(2) if rank == 0 else object(),
    }[kind]
    try:
        mp_sync(data)
    except (CollectiveMismatchError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("kind", "CollectiveMismatchError: mp_sync: ranks passed incompatible values"),
        ("dtype", "rank 0: tensor (tensor) float32 (2,); rank 1: tensor (tensor) float64 (2,)"),
        ("trailing", "rank 0: tensor (tensor) float32 (2, 3); rank 1: tensor (tensor) float32 (2, 4)"),
        ("type", "TypeError: mp_sync: rank 1: mp_sync syncs tensors, numpy arrays, lists, tuples and numbers"),
    ],
)
def test_mp_sync_mismatches_raise_on_every_rank(kind: str, message: str) -> None:
    for result in run_parallel(_mp_mismatch, kind):
        assert message in result


def _mp_dict() -> dict[str, Any]:
    rank = dist.get_rank()
    synced = mp_sync_dict({"loss": [0.5 * rank], "ids": torch.tensor([rank, rank]), "names": [f"n{rank}"]})
    return {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in synced.items()}


def test_mp_sync_dict_syncs_every_key_in_one_go() -> None:
    assert run_parallel(_mp_dict, world_size=3)[2] == {
        "loss": [0.0, 0.5, 1.0], "ids": [0, 0, 1, 1, 2, 2], "names": ["n0", "n1", "n2"]
    }  # fmt: skip


# --- OML's sync_dicts_ddp / merge_list_of_dicts ---------------------------------------------------------


def oml_outputs(rank: int, rows: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rank)
    return {
        "embeddings": torch.randn(rows + rank, 8, generator=generator),
        "labels": torch.arange(rows + rank) + 100 * rank,
        "paths": [f"img/{rank}/{i}.png" for i in range(rows + rank)],
        "scores": np.linspace(0, 1, rows + rank) + rank,
        "pair": tuple(range(rank + 1)),
    }


def _sync_dicts(rows: int) -> bool:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    merged = sync_dicts_ddp(oml_outputs(rank, rows), world_size, device="cpu")
    expected = merge_list_of_dicts([oml_outputs(r, rows) for r in range(world_size)])
    return (
        merged.keys() == expected.keys()
        and torch.equal(merged["embeddings"], expected["embeddings"])
        and torch.equal(merged["labels"], expected["labels"])
        and merged["paths"] == expected["paths"]
        and np.array_equal(merged["scores"], expected["scores"])
        and merged["pair"] == expected["pair"]
        and isinstance(merged["pair"], tuple)
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("rows", [3, 40000])  # in the metadata exchange / straight into the joined buffers
def test_sync_dicts_ddp_merges_like_oml_without_pickling_tensors(world_size: int, rows: int) -> None:
    assert run_parallel(_sync_dicts, rows, world_size=world_size) == [True] * world_size


def _sync_dicts_bad(kind: str) -> str:
    rank = dist.get_rank()
    outputs: dict[str, Any] = {"a": [rank]}
    world_size = dist.get_world_size()
    if kind == "keys" and rank == 1:
        outputs = {"b": [rank]}
    elif kind == "type" and rank == 1:
        outputs = {"a": 3}
    elif kind == "world_size" and rank == 1:
        world_size = 5
    try:
        sync_dicts_ddp(outputs, world_size)
    except (CollectiveMismatchError, TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("keys", "CollectiveMismatchError: sync_dicts_ddp: ranks passed different keys: rank 0: ['a']; rank 1: ['b']"),
        (
            "type",
            "TypeError: sync_dicts_ddp: rank 1: only lists, tuples, tensors and numpy arrays can be merged; "
            "got int for key 'a'",
        ),
        ("world_size", "ValueError: sync_dicts_ddp: rank 1: world_size=5 but the process group has 2 ranks"),
    ],
)
def test_sync_dicts_ddp_bad_input_raises_on_every_rank(kind: str, message: str) -> None:
    for result in run_parallel(_sync_dicts_bad, kind):
        assert result == message


def _sync_paths() -> list[Any]:
    rank = dist.get_rank()
    merged = sync_dicts_ddp({"paths": [Path(f"img/{rank}/{i}.png") for i in range(rank + 1)]}, dist.get_world_size())
    return merged["paths"]


def test_sync_dicts_ddp_sends_lists_of_paths_without_pickle() -> None:
    """OML's own use: the dataset's paths beside the embeddings; OML pickles them, here they travel as text."""
    expected = [Path("img/0/0.png"), Path("img/1/0.png"), Path("img/1/1.png")]
    assert run_parallel(_sync_paths) == [expected, expected]
