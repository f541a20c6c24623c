"""One job, whatever the way in: entry point x way of starting x data, each checked for the DDP invariants.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_one_job.py and
tests/e2e/test_one_job.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.testing import run_parallel
from tests.e2e import one_job
from tests.helpers import SETTLED_FORK
from tests.support.one_job import _as_in_the_ddp_tutorial, check_case

CASES = [(entry, data) for entry in one_job.ENTRY_POINTS for data in one_job.DATA]
#: Each case's final weights in the session pool, computed once per session.
_REFERENCE: dict[tuple[str, str], list[float]] = {}


# --- in the session pool: processes that made their group with init_process_group(rank=, world_size=) ---------


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("entry", "data"), CASES)
def test_every_entry_point_is_one_job_under_a_group_made_by_hand(entry: str, data: str, tmp_path: Path) -> None:
    results = run_parallel(_as_in_the_ddp_tutorial, entry, data, str(tmp_path), timeout=60)
    assert all(result["group_before"] for result in results)
    check_case(results)
    _REFERENCE[entry, data] = results[0]["weights"]


# --- the rule, entry point by entry point, without processes --------------------------------------------


def _handler_given(world_size: int, rank: int | None) -> str:
    loop = one_job._AitoolboxStyleLoop(one_job.train_loader("map0"))
    try:
        ddpkit.DDPHandler(loop).add_distributed_samplers(world_size, ddpkit.get_rank() if rank is None else rank)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_ddp_handler_given_a_contradicting_rank_raises_on_every_rank_naming_each_ranks_values() -> None:
    assert run_parallel(_handler_given, 2, None) == ["accepted", "accepted"]
    results = run_parallel(_handler_given, 2, 0)  # every rank says it is rank 0
    assert len(set(results)) == 1
    assert "(rank 0: world_size=2, rank=0, rank 1: world_size=2, rank=0)" in results[0]
    assert "pass world_size=ddpkit.get_world_size(), rank=ddpkit.get_rank()" in results[0]


def test_a_stream_in_a_worker_whose_process_had_no_group_under_a_launcher_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain DataLoader over a ShardedStream, iterated before the group exists in a launcher's process: the
    forked worker cannot know its rank and says so instead of reading the whole stream."""
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29400"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DDPKIT_CLUSTER_ENV", raising=False)
    stream = ddpkit.ShardedStream(one_job.IndexedDigitsStream())
    loader = DataLoader(stream, batch_size=4, num_workers=1, multiprocessing_context=SETTLED_FORK)
    with pytest.raises(ddpkit.DDPKitError, match="cannot tell its rank"):
        next(iter(loader))
    assert not ddpkit.is_distributed()


def _train_on_prebuilt_sampler(loader: DataLoader[Any]) -> tuple[int, int, list[int]]:
    loop = one_job._AitoolboxStyleLoop(loader)
    ddpkit.DDPHandler(loop).add_distributed_samplers(dist.get_world_size(), dist.get_rank())
    sampler = loop.train_loader.sampler
    return sampler.num_replicas, sampler.rank, [int(i) for i in sampler]


def test_a_sampler_built_with_default_placement_before_the_group_takes_each_ranks_place() -> None:
    # built here, where there is no group (as before fit_distributed), then pickled to the ranks
    loader = DataLoader(range(10), sampler=ddpkit.DistributedSamplerWrapper(range(10)))
    results = run_parallel(_train_on_prebuilt_sampler, loader)
    assert [(replicas, rank) for replicas, rank, _ in results] == [(2, 0), (2, 1)]
    assert sorted(index for *_, indices in results for index in indices) == list(range(10))


def _handler_error(loader: DataLoader[Any]) -> str:
    try:
        ddpkit.DDPHandler(one_job._AitoolboxStyleLoop(loader)).add_distributed_samplers(2, dist.get_rank())
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_sampler_built_for_another_rank_raises_on_every_rank() -> None:
    loader = DataLoader(range(10), sampler=ddpkit.DistributedSamplerWrapper(range(10), num_replicas=2, rank=0))
    results = run_parallel(_handler_error, loader)  # every rank got rank 0's sampler: rank 1 finds it
    assert results[1].startswith("the train_loader's DistributedSamplerWrapper was built for rank 0 of 2, but this ")
    assert (
        results[0] == "rank(s) 1 found a loader sharded for another rank or world size (their error says which); "
        "this rank stops too"
    )
