"""Elastic training: a global batch kept on any world size, epochs resumed in entries of the global order.

The unit tests run in the session pool; the two end-to-end tests (marked e2e) start two agents as two
nodes of `--nnodes 1:2` on loopback, then lose one (SIGKILL) or add one part-way through.

Here, the tests that need no process; the others are in tests/ranks/test_elastic.py and tests/e2e/test_elastic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddpkit import TrainLoop
from ddpkit.checkpoint import CHECKPOINT_FILE, load_checkpoint, save_checkpoint
from ddpkit.jobs._agent import node_range, rdzv_configs
from ddpkit.samplers import EpochLayout
from ddpkit.training._steps import GlobalBatch
from tests.builders import digits_loop
from tests.helpers import StopAfter
from tests.support.elastic import _max_difference, _refused

# --- the global batch: steps and weights ---------------------------------------------------------


def test_a_world_size_that_cannot_reach_the_global_batch_is_refused_naming_those_that_can() -> None:
    assert GlobalBatch(96).accumulation(3, 16) == 2
    with pytest.raises(ValueError, match=r"global_batch_size=64 cannot be reached on 3 rank\(s\) .* runs on 1, 2 rank"):
        GlobalBatch(64).accumulation(3, 32)
    with pytest.raises(ValueError, match="no world size can: make it a multiple of 48"):
        GlobalBatch(64).accumulation(1, 48)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        GlobalBatch(0)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 7])
def test_each_item_of_a_step_weighs_one_over_the_steps_items(world_size: int, start: int) -> None:
    """Batches of uneven size (a batch sampler whose last batch is short), a resumed start, a short last step:
    DDP's mean over ranks of each rank's weighted batch means is the mean over the step's items."""
    sizes = torch.tensor([4] * 20 + [3])  # 21 batches of a batch sampler: 83 items
    shuffled = torch.randperm(21, generator=torch.Generator().manual_seed(1))
    layout = EpochLayout(len(sizes), world_size, "uneven", shuffled, sizes, start=start)
    steps = [GlobalBatch(24).epoch(layout, rank, 1, 0, 0) for rank in range(world_size)]
    weight: dict[int, float] = {}  # step -> sum over its items of each item's weight
    positions: dict[int, list[int]] = {}
    for rank, plan in enumerate(steps):
        for index in range(layout.shard_length(rank)):
            step = index // plan.accumulation
            # the batch's items together: 1 / divisor (the batch mean's weight), then DDP's mean over W ranks
            weight[step] = weight.get(step, 0.0) + 1 / plan.divisor(index) / world_size
            positions.setdefault(step, []).append(start + rank + world_size * index)
            assert plan.ends_step(index) == ((index + 1) % plan.accumulation == 0 and step < plan.full_steps)
    assert all(abs(total - 1.0) < 1e-12 for total in weight.values()), weight
    for step, used in positions.items():  # a step holds the positions [start + 6s, start + 6s + 6): 24 items
        assert sorted(used) == list(range(start + 6 * step, min(21, start + 6 * step + 6)))
    assert steps[0].final_step == ((21 - start) % 6 != 0)


# --- training on 1, 2 and 3 ranks ----------------------------------------------------------------


def test_a_global_batch_refuses_grad_accumulation_and_drop_last() -> None:
    assert "pass one" in _refused(64, accumulation=2)
    assert "drop_last=False" in _refused(64, drop_last=True)


# --- resuming on another number of ranks ----------------------------------------------------------


def test_a_checkpoint_of_ddpkit_0_1_resumes_at_its_batch(tmp_path: Path) -> None:
    """Version 1 counted the position in batches per rank; it is read as that many entries of all ranks."""

    def loop(directory: Path) -> TrainLoop:
        return digits_loop(validation_batch_size=None, seed=2, checkpoint_dir=directory, checkpoint_every=5)

    with pytest.raises(KeyboardInterrupt):
        loop(tmp_path / "new").fit(1, callbacks=[StopAfter(6)])  # the checkpoint of step 5 stays
    state = load_checkpoint(tmp_path / "new" / CHECKPOINT_FILE)
    assert (state.pop("version"), state["position"], state.pop("stream")) == (5, 5 * 32, None)
    assert (state.pop("recipe"), state.pop("skipped_steps"), state.pop("sharded")) == ({}, 0, None), (
        "fields that version 1 lacks"
    )
    state["batch"] = state.pop("position") // 32
    save_checkpoint({"version": 1, **state}, tmp_path / "old" / CHECKPOINT_FILE)
    new, old = loop(tmp_path / "new"), loop(tmp_path / "old")
    new.fit(1)
    old.fit(1)
    assert _max_difference(new.model.state_dict(), old.model.state_dict()) == 0.0
    assert new.history["train_loss"] == old.history["train_loss"]


# --- launching: nnodes MIN:MAX ----------------------------------------------------------------------


def test_nnodes_takes_a_number_or_torchruns_min_max() -> None:
    assert [node_range(n) for n in (1, "3", "1:2", " 2:4 ")] == [(1, 1), (3, 3), (1, 2), (2, 4)]
    for bad in (0, "2:1", "a", "1:", True, "0:2"):
        with pytest.raises(ValueError, match="must be a number of nodes >= 1, or 'MIN:MAX'"):
            node_range(bad)  # type: ignore[arg-type]
    assert rdzv_configs(9.6, "last_call_timeout=2, keep_alive_interval=1") == {
        "last_call_timeout": "2", "keep_alive_interval": "1", "join_timeout": 10,
    }  # fmt: skip
    with pytest.raises(ValueError, match="KEY=VALUE"):
        rdzv_configs(None, "last_call_timeout")


def test_losing_the_rendezvous_host_is_named() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from ddpkit.jobs._agent import _rendezvous_failed

    message = str(_rendezvous_failed(RendezvousConnectionError("lost"), "127.0.0.1:29400", "1:2", None))
    assert "cannot reach the rendezvous store at 127.0.0.1:29400" in message
    assert "a job survives losing any node but that one" in message
