"""sync_ddp / sync_ddp_if_available, as in Lightning: every op, exact values, mismatches raise on every rank.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_reduce.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import CollectiveMismatchError, sync_ddp
from ddpkit.testing import run_parallel

WORLD_SIZES = [2, 3]


def _values(op: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[list[Any], str, tuple[int, ...], bool]:
    rank = dist.get_rank()
    tensor = (torch.arange(int(torch.tensor(shape).prod().item())) + 1 + rank).reshape(shape).to(dtype)
    result = sync_ddp(tensor, reduce_op=op)
    return result.tolist(), str(result.dtype), tuple(result.shape), result is tensor


def _expected(op: str, dtype: torch.dtype, shape: tuple[int, ...], world_size: int) -> torch.Tensor:
    base = torch.arange(int(torch.tensor(shape).prod().item())) + 1
    stacked = torch.stack([(base + r).reshape(shape).to(dtype) for r in range(world_size)]).double()
    if op in ("sum", None):
        return stacked.sum(0)
    if op in ("mean", "avg"):
        return stacked.mean(0)
    if op == "max":
        return stacked.max(0).values
    if op == "min":
        return stacked.min(0).values
    return stacked.prod(0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", [None, "sum", "mean", "avg", "MAX", "min", "prod"])
@pytest.mark.parametrize("shape", [(), (1,), (3, 2), (600,)])  # scalar path, ride-along path, native path
def test_every_op_on_float_tensors(world_size: int, op: str | None, shape: tuple[int, ...]) -> None:
    results = run_parallel(_values, op, torch.float64, shape, world_size=world_size)
    expected = _expected((op or "sum").lower(), torch.float64, shape, world_size)
    for values, dtype, result_shape, in_place in results:
        assert torch.allclose(torch.tensor(values, dtype=torch.float64), expected, rtol=1e-12)
        assert (dtype, result_shape, in_place) == ("torch.float64", shape, True), "Lightning's: the input holds it"


@pytest.mark.parametrize(
    ("op", "name"),
    [(dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "mean"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min"),
     (dist.ReduceOp.PRODUCT, "prod")],
)  # fmt: skip
def test_reduce_op_values_are_accepted(op: Any, name: str) -> None:
    results = run_parallel(_values, op, torch.float32, (2,))
    expected = _expected(name, torch.float32, (2,), 2)
    assert torch.allclose(torch.tensor(results[0][0], dtype=torch.float64), expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shape", [(), (4,), (300,)])
def test_integer_mean_keeps_the_dtype_like_lightning_and_integer_sum_stays_exact(
    world_size: int, shape: tuple[int, ...]
) -> None:
    results = run_parallel(_values, "mean", torch.int64, shape, world_size=world_size)
    assert results[0][1] == "torch.int64"
    truncated = _expected("mean", torch.int64, shape, world_size).trunc()  # 2 ranks: x.5 -> x
    assert torch.equal(torch.tensor(results[0][0]).double(), truncated)
    assert results[0][3], "in place"
    sums = run_parallel(_values, "sum", torch.int32, shape, world_size=world_size)
    assert sums[0][1] == "torch.int32"
    assert torch.equal(torch.tensor(sums[0][0]).double(), _expected("sum", torch.int32, shape, world_size))


def _huge_int64() -> list[int]:
    value = torch.tensor([2**60 + dist.get_rank(), -(2**61)], dtype=torch.int64)
    return sync_ddp(value).tolist()


def test_int64_beyond_float64_precision_is_summed_exactly() -> None:
    """2**61 + 1 is not a float64: only the native int64 path gets the last bit right."""
    assert run_parallel(_huge_int64)[0] == [2**61 + 1, -(2**62)]


def _numbers() -> list[tuple[Any, str]]:
    rank = dist.get_rank()
    out = []
    for number, op in ((rank + 1, "sum"), (0.5 * (rank + 1), "mean"), (rank == 0, "max"), (rank + 1, "mean")):
        result = sync_ddp(number, reduce_op=op)
        out.append((result.item(), str(result.dtype)))
    return out


def test_python_numbers_are_accepted() -> None:
    assert run_parallel(_numbers)[1] == [
        (3, "torch.int64"),
        (0.75, "torch.float64"),
        (True, "torch.bool"),
        (1.5, "torch.float32"),
    ]


def test_half_precision_mean_is_rounded_once() -> None:
    results = run_parallel(_values, "mean", torch.bfloat16, (3,))
    assert results[0][1] == "torch.bfloat16"
    assert results[0][0] == [1.5, 2.5, 3.5]


def _mismatched(kind: str) -> tuple[str, str, float]:
    rank = dist.get_rank()
    if kind == "shape":
        args: tuple[Any, ...] = (torch.ones(4 if rank == 0 else 3),)
    elif kind == "dtype":
        args = (torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64),)
    elif kind == "op":
        args = (torch.ones(4), None, "sum" if rank == 0 else "max")
    elif kind == "scalar vs vector":
        args = (torch.ones(()) if rank == 0 else torch.ones(300),)
    else:
        args = ("not a number" if rank == 1 else torch.ones(2),)
    try:
        sync_ddp(*args)
    except (CollectiveMismatchError, TypeError) as exc:
        caught = (type(exc).__name__, str(exc))
    else:
        caught = ("", "")
    check = torch.ones(1)
    dist.all_reduce(check)  # the group still works
    return caught[0], caught[1], check.item()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("shape", "CollectiveMismatchError", "rank 0: float32 (4,) sum; rank 1: float32 (3,) sum"),
        ("dtype", "CollectiveMismatchError", "rank 0: float32 (4,) sum; rank 1: float64 (4,) sum"),
        ("op", "CollectiveMismatchError", "rank 0: float32 (4,) sum; rank 1: float32 (4,) max"),
        ("scalar vs vector", "CollectiveMismatchError", "rank 0: float32 () sum; rank 1: float32 (300,) sum"),
        ("type", "TypeError", "rank 1: sync_ddp reduces a tensor or a number, got str"),
    ],
)
def test_mismatched_inputs_raise_on_every_rank(world_size: int, kind: str, error: str, message: str) -> None:
    for name, text, check in run_parallel(_mismatched, kind, world_size=world_size):
        assert (name, check) == (error, float(world_size))
        assert message in text


def _subgroup_sum() -> float:
    group = dist.new_group([0, 1])
    if dist.get_rank() > 1:
        return -1.0
    return sync_ddp(torch.tensor(float(dist.get_rank() + 1)), group=group).item()


def test_a_subgroup_reduces_over_its_own_ranks() -> None:
    assert run_parallel(_subgroup_sum, world_size=3) == [3.0, 3.0, -1.0]


def _in_place(requires_grad: bool) -> tuple[bool, list[float], list[float], bool]:
    rank = dist.get_rank()
    tensor = torch.tensor([1.0 + rank, 2.0 + rank], requires_grad=requires_grad)
    result = sync_ddp(tensor, reduce_op="mean")
    base = torch.arange(8.0).reshape(2, 4) + 10 * rank
    sync_ddp(base[:, ::2])  # not contiguous: reduced in a copy, written back into the view
    return result is tensor, tensor.tolist(), base.tolist(), tensor.requires_grad


def test_the_input_holds_the_result_even_when_it_requires_grad_or_is_not_contiguous() -> None:
    """Lightning's tests assert ``sync_ddp(t) is t``; ``sync_ddp(t); use(t)`` must use the reduced values."""
    for rank, (same, values, base, requires_grad) in enumerate(run_parallel(_in_place, True)):
        assert (same, values, requires_grad) == (True, [1.5, 2.5], True)
        others = 10 * rank
        assert base == [[10.0, 1.0 + others, 14.0, 3.0 + others], [18.0, 5.0 + others, 22.0, 7.0 + others]]


def _special(values: list[float], op: str) -> list[float]:
    tensor = torch.tensor(values[dist.get_rank()], dtype=torch.float32)
    return [sync_ddp(tensor, reduce_op=op).item(), sync_ddp(torch.tensor([1.0, 2.0]), reduce_op=op).tolist()[0]]


@pytest.mark.parametrize(
    ("values", "op", "expected"),
    [
        ([float("nan"), 1.0], "mean", "nan"),
        ([float("inf"), 1.0], "sum", "inf"),
        ([float("inf"), -float("inf")], "sum", "nan"),
    ],
)
def test_nan_and_infinite_scalars_reduce_as_floats_do(values: list[float], op: str, expected: str) -> None:
    """The scalar probe marks a rank that cannot take it with NaN: a NaN value takes the checked path, still exact."""
    for result, after in run_parallel(_special, values, op):
        assert str(result) == expected
        assert after == (1.0 if op == "mean" else 2.0), "the next call is unaffected"
