"""sync_ddp / sync_ddp_if_available, as in Lightning: every op, exact values, mismatches raise on every rank.

Here, the tests that need no process; the others are in tests/ranks/test_reduce.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit import sync_ddp, sync_ddp_if_available


def test_unknown_op_lists_the_valid_ones_without_a_process_group() -> None:
    with pytest.raises(ValueError, match=r"reduce_op='median' is not supported; use 'sum', 'mean' \(or 'avg'\)"):
        sync_ddp(torch.ones(2), reduce_op="median")
    with pytest.raises(ValueError, match=r"PREMUL_SUM|is not supported"):
        sync_ddp(torch.ones(2), reduce_op=dist.ReduceOp.PREMUL_SUM)  # type: ignore[arg-type]


def test_without_a_process_group_the_result_is_the_input_unchanged() -> None:
    tensor = torch.tensor([1, 2])
    for reduce in (sync_ddp, sync_ddp_if_available):
        for op in ("sum", "mean", "max"):
            assert reduce(tensor, reduce_op=op) is tensor, "Lightning's sync_ddp_if_available returns it as it is"
        assert tensor.tolist() == [1, 2]
        assert reduce(3.5).item() == 3.5
    with pytest.raises(TypeError, match="got str"):
        sync_ddp("x")  # type: ignore[arg-type]


def test_in_a_group_of_one_the_reduction_is_the_value_itself_without_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over one rank every op gives the value back, as without a group: no all_reduce is issued (it would cost
    a round trip through the backend for nothing)."""
    from ddpkit import LocalEnvironment, init_dist_connection
    from tests.helpers import free_port

    init_dist_connection(LocalEnvironment({"MASTER_PORT": str(free_port())}), "gloo", global_rank=0, world_size=1)

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective in a group of one")

    monkeypatch.setattr(dist, "all_reduce", refused)
    tensor = torch.tensor([1, 2])
    for op in ("sum", "mean", "max", "prod"):
        assert sync_ddp(tensor, reduce_op=op) is tensor
    assert tensor.tolist() == [1, 2]
    assert sync_ddp(2.5, reduce_op="mean").item() == 2.5
    with pytest.raises(TypeError, match="got str"):
        sync_ddp("x")  # type: ignore[arg-type]
