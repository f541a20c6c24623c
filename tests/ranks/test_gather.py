"""Lightning's gather_all_tensors, all_gather_ddp_if_available and AllGatherGrad.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_gather.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import AllGatherGrad, CollectiveMismatchError, all_gather_ddp_if_available, gather_all_tensors
from ddpkit.testing import run_parallel

WORLD_SIZES = [2, 3]


def make(rank: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + rows)
    values = torch.randn(rows, cols, generator=generator, dtype=torch.float64) * 1000
    return values.to(dtype)


def _gather_shapes(cols: list[int], rows: list[int], dtype: torch.dtype) -> list[tuple[tuple[int, ...], bool]]:
    rank = dist.get_rank()
    mine = make(rank, rows[rank], cols[rank], dtype)
    gathered = gather_all_tensors(mine)
    return [
        (tuple(t.shape), bool(torch.equal(t, make(r, rows[r], cols[r], dtype))) and t.dtype == dtype)
        for r, t in enumerate(gathered)
    ]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.int64, torch.bfloat16, torch.float64, torch.bool, torch.complex64, torch.uint16]
)
def test_any_dimension_may_differ_and_values_are_exact(world_size: int, dtype: torch.dtype) -> None:
    rows, cols = [3, 0, 5][:world_size], [4, 1, 2][:world_size]
    for result in run_parallel(_gather_shapes, cols, rows, dtype, world_size=world_size):
        assert result == [((rows[r], cols[r]), True) for r in range(world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("rows", [[2, 3, 1], [2000, 10, 700], [30000, 37000, 1]])  # inline, padded, broadcasts
def test_small_medium_and_large_payloads(world_size: int, rows: list[int]) -> None:
    for result in run_parallel(_gather_shapes, [64] * 3, rows, torch.float32, world_size=world_size):
        assert result == [((rows[r], 64), True) for r in range(world_size)]


def _scalars_and_empties() -> list[Any]:
    rank = dist.get_rank()
    zero_d = gather_all_tensors(torch.tensor(rank * 1.5))
    empty = gather_all_tensors(torch.empty(0, 3, dtype=torch.int64))
    mine = torch.arange(3.0)
    own = gather_all_tensors(mine)[rank]
    return [[t.item() for t in zero_d], [tuple(t.shape) for t in empty], own.data_ptr() == mine.data_ptr()]


def test_zero_d_and_empty_tensors_and_the_own_entry_is_not_copied() -> None:
    assert run_parallel(_scalars_and_empties, world_size=3) == [[[0.0, 1.5, 3.0], [(0, 3)] * 3, True]] * 3


def _views() -> list[list[float]]:
    rank = dist.get_rank()
    base = torch.arange(24.0).reshape(4, 6) + 100 * rank
    transposed = gather_all_tensors(base.t())  # not contiguous
    offset = gather_all_tensors(base[1:, 2:4])  # a view starting inside its storage
    return [t.flatten().tolist() for t in transposed + offset]


def test_non_contiguous_and_offset_views_arrive_as_their_values() -> None:
    bases = [torch.arange(24.0).reshape(4, 6) + 100 * r for r in range(2)]
    expected = [b.t().flatten().tolist() for b in bases] + [b[1:, 2:4].flatten().tolist() for b in bases]
    assert run_parallel(_views, world_size=2) == [expected] * 2


def _mismatch(kind: str) -> tuple[str, str, float]:
    rank = dist.get_rank()
    inputs = {
        "ndim": torch.zeros(4, 8) if rank == 0 else torch.zeros(4),
        "dtype": torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.int64),
        "type": torch.zeros(2) if rank == 0 else [1.0, 2.0],
    }
    try:
        gather_all_tensors(inputs[kind])
        caught = ("", "")
    except (CollectiveMismatchError, TypeError) as exc:
        caught = (type(exc).__name__, str(exc))
    total = torch.ones(1)
    dist.all_reduce(total)
    return caught[0], caught[1], total.item()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    ("kind", "error", "message"),
    [
        ("ndim", "CollectiveMismatchError", "rank 0: float32 (4, 8); rank 1: float32 (4,)"),
        ("dtype", "CollectiveMismatchError", "rank 0: float32 (2,); rank 1: int64 (2,)"),
        ("type", "TypeError", "rank 1: gather_all_tensors needs a tensor, got list"),
    ],
)
def test_mismatches_raise_on_every_rank_and_the_group_survives(
    world_size: int, kind: str, error: str, message: str
) -> None:
    for name, text, total in run_parallel(_mismatch, kind, world_size=world_size):
        assert (name, total) == (error, float(world_size))
        assert message in text


def _stacked(sync_grads: bool) -> tuple[tuple[int, ...], list[list[float]], bool]:
    rank = dist.get_rank()
    tensor = torch.full((2,), float(rank), requires_grad=True)
    out = all_gather_ddp_if_available(tensor, sync_grads=sync_grads)
    return tuple(out.shape), out.tolist(), out.requires_grad


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_ddp_if_available_returns_world_by_shape(world_size: int) -> None:
    rows = [[float(r)] * 2 for r in range(world_size)]
    assert run_parallel(_stacked, False, world_size=world_size)[0] == ((world_size, 2), rows, False)
    assert run_parallel(_stacked, True, world_size=world_size)[0] == ((world_size, 2), rows, True)


def _unequal_stack() -> str:
    try:
        all_gather_ddp_if_available(torch.ones(dist.get_rank() + 1))
    except CollectiveMismatchError as exc:
        return str(exc)
    return ""


def test_all_gather_ddp_if_available_needs_equal_shapes() -> None:
    for message in run_parallel(_unequal_stack):
        assert "need the same dtype and shape" in message
        assert "rank 0: float32 (1,); rank 1: float32 (2,)" in message


def _gradient() -> list[float]:
    """Rank r's loss weighs row k of the gathered tensor by (r + 1) * (k + 1)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(rank), requires_grad=True)
    gathered = AllGatherGrad.apply(x)
    weights = torch.arange(1, world_size + 1, dtype=torch.float32).reshape(-1, 1) * (rank + 1)
    (gathered * weights).sum().backward()
    assert x.grad is not None
    return x.grad.tolist()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_grad_sums_every_ranks_gradient_for_this_ranks_slice(world_size: int) -> None:
    """d(sum of all ranks' losses)/dx_k = (k + 1) * (1 + 2 + ... + W), and each rank k gets exactly that."""
    total = world_size * (world_size + 1) / 2
    results = run_parallel(_gradient, world_size=world_size)
    assert results == [[(k + 1) * total] * 3 for k in range(world_size)]


def _local_graph() -> tuple[bool, list[float], bool]:
    rank = dist.get_rank()
    x = torch.arange(3.0, requires_grad=True)
    gathered = gather_all_tensors(x * (rank + 1))
    (grad,) = torch.autograd.grad(gathered[rank].sum(), x)  # torchmetrics' and Lightning's keep this graph
    others = [t.requires_grad for r, t in enumerate(gathered) if r != rank]
    return gathered[rank].requires_grad, grad.tolist(), any(others)


def test_this_ranks_entry_keeps_its_autograd_graph() -> None:
    for rank, (requires_grad, grad, others) in enumerate(run_parallel(_local_graph)):
        assert (requires_grad, grad, others) == (True, [rank + 1.0] * 3, False)


def _cuda_round_trip() -> tuple[str, ...]:
    device = torch.device("cuda", 0)
    gathered = gather_all_tensors(torch.ones(dist.get_rank() + 1, device=device))
    return tuple(str(t.device) for t in gathered)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tensors must come back on it)")
def test_cuda_tensors_come_back_on_their_device() -> None:
    assert run_parallel(_cuda_round_trip) == [("cuda:0", "cuda:0")] * 2


def _subgroup_gathers() -> list[Any]:
    group = dist.new_group([1, 2])
    rank = dist.get_rank()
    if rank == 0:
        return []
    mine = torch.full((rank, 2), float(rank))
    small = [t.tolist() for t in gather_all_tensors(mine, group=group)]
    large = [t.shape[0] for t in gather_all_tensors(torch.zeros(3000 * rank, 8), group=group)]  # not inline
    return [small, large, all_gather_ddp_if_available(torch.tensor([rank]), group=group).tolist()]


def test_a_subgroup_gathers_over_its_own_ranks_in_their_order() -> None:
    expected = [[[[1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0]]], [3000, 6000], [[1], [2]]]
    assert run_parallel(_subgroup_gathers, world_size=3) == [[], expected, expected]
