"""Sharded training's parts that need no process group: which modules are units, the final step every rank runs
as often, an unsharded run's optimizer state by name, sharded checkpoint directories.

Here, the tests that run in one process; the others are in tests/ranks/test_fsdp.py and tests/e2e/test_sharded.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit import FSDPPlugin
from ddpkit._fsdp_units import choose_units
from ddpkit.checkpoint import load_sharded, save_sharded
from ddpkit.fsdp_plugin import _named
from ddpkit.samplers import EpochLayout
from ddpkit.training import TrainState
from ddpkit.training._steps import GlobalBatch
from tests.support.sharded import Block, Stack


def test_the_default_units_are_the_layers_of_the_outermost_stacks() -> None:
    stack = Stack(depth=3)
    assert choose_units(stack, None) == list(reversed(stack.blocks)), "the blocks, not the layers inside them"
    sequential = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)))
    assert choose_units(sequential, None) == [sequential[2], sequential[0]], "children with parameters, last first"
    assert choose_units(nn.Linear(2, 2), None) == [], "no stack: only the model itself"


def test_a_wrap_policy_of_classes_or_a_callable_picks_children_before_parents() -> None:
    stack = Stack(depth=2)
    by_class = choose_units(stack, {Block, nn.LayerNorm})
    assert {id(m) for m in by_class} == {id(m) for b in stack.blocks for m in (b, b.norm)}
    assert all(by_class.index(b.norm) < by_class.index(b) for b in stack.blocks), "a unit's parts go first"
    assert choose_units(stack, lambda m: m is stack.head) == [stack.head]
    with pytest.raises(TypeError, match=r"nn\.Module classes"):
        FSDPPlugin(auto_wrap_policy={"Block"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("items", "world_size", "own", "expected"),
    [(201, 2, [2, 1], 2), (202, 3, [1, 1, 1], 1), (192, 2, [0, 0], 0), (205, 3, [2, 1, 1], 2)],
)
def test_the_final_step_runs_as_many_batches_on_every_rank_as_the_rank_with_most(
    items: int, world_size: int, own: list[int], expected: int
) -> None:
    """24 items a step in batches of 4, after 8 full steps: 201 items leave 9 for the final step (2 ranks: 5 and 4
    items, 2 batches and 1); 202 on 3 ranks leave 10 (4, 3, 3 items: 1 batch each); 205 leave 13 (5, 4, 4)."""
    layout = EpochLayout(items, world_size, "uneven")
    steps = [GlobalBatch(24).epoch(layout, rank, 4, 0, 0) for rank in range(world_size)]
    assert [-(-layout.shard_length(rank) // 4) - 8 * steps[rank].accumulation for rank in range(world_size)] == own
    assert {s.final_batches() for s in steps} == {expected}
    full = steps[0].full_steps * steps[0].accumulation
    assert [s.in_final_step(full - 1) for s in steps] == [False] * world_size
    assert [s.in_final_step(full) for s in steps] == [bool(expected)] * world_size


def test_a_whole_optimizer_state_is_named_by_the_groups_it_was_built_with() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = torch.optim.SGD([{"params": model[1].parameters()}, {"params": model[0].parameters(), "lr": 1.0}],
                                lr=0.1, momentum=0.9)  # fmt: skip
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    named = _named(optimizer.state_dict(), optimizer, model)
    assert [g["params"] for g in named["param_groups"]] == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    buffer = optimizer.state[model[0].weight]["momentum_buffer"]
    assert torch.equal(named["state"]["0.weight"]["momentum_buffer"], buffer)
    fewer = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="has 4 parameters and this optimizer 2"):
        _named(optimizer.state_dict(), fewer, model)


def test_a_sharded_checkpoint_is_renamed_into_place_and_unnamed_ones_go(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0)}, "optimizer": {"step": torch.tensor(3.0)}}
    path = save_sharded(state, tmp_path, "last-e0-s3-p9.dcp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-e0-s3-p9.dcp"], "no temporary directory left"
    loaded = {"model": {"w": torch.zeros(6)}, "optimizer": {"step": torch.tensor(0.0)}}
    load_sharded(loaded, path)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0))
    (tmp_path / "last-e0-s1-p3.dcp").mkdir()  # an older checkpoint's
    (tmp_path / ".last-e0-s6-p18.dcp.tmp").mkdir()  # a write that did not finish
    (tmp_path / "notes.dcp.txt").write_text("the user's")
    (tmp_path / "mine.dcp").mkdir()  # the user's own
    TrainState({}, {}, 0, 9, torch.zeros(2), 3, 0, 1, [], sharded=path.name).save(tmp_path / "last.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-e0-s3-p9.dcp", "last.pt", "mine.dcp", "notes.dcp.txt"]
    with pytest.raises(FileNotFoundError, match="metadata"):
        load_sharded(loaded, tmp_path / "last-e0-s1-p3.dcp")


def test_a_sharded_checkpoint_written_again_under_its_name_is_never_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same name written again: the old directory is renamed aside before the new one goes in place, so a crash
    between the two renames leaves the old one, which load_sharded reads; after the write only the new one is left."""
    import ddpkit.checkpoint as checkpoint

    def state(value: float) -> dict[str, Any]:
        return {"model": {"w": torch.full((4,), value)}}

    path = save_sharded(state(1.0), tmp_path, "last-e0-s3-p9.dcp")
    real_replace, crashed = os.replace, []

    def crash_after_the_first_rename(source: Any, destination: Any) -> None:
        real_replace(source, destination)
        if Path(destination).name.endswith(".old"):
            crashed.append(True)
            raise KeyboardInterrupt("killed between the renames")

    monkeypatch.setattr(checkpoint.os, "replace", crash_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        save_sharded(state(2.0), tmp_path, "last-e0-s3-p9.dcp")
    assert crashed
    assert not path.exists(), "the name is empty between the renames"
    loaded = state(0.0)
    load_sharded(loaded, path)
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 1.0)), "the old checkpoint, whole"
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    save_sharded(state(3.0), tmp_path, "last-e0-s3-p9.dcp")
    load_sharded(loaded, path)
    assert torch.equal(loaded["model"]["w"], torch.full((4,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last-e0-s3-p9.dcp"], "nothing aside or unfinished left"


def test_a_checkpoint_of_the_previous_version_has_no_sharded_directory(tmp_path: Path) -> None:
    TrainState({}, {}, 0, 0, torch.zeros(2), 0, 0, 1, []).save(tmp_path / "last.pt")
    data = torch.load(tmp_path / "last.pt", weights_only=True)
    del data["sharded"]
    data["version"] = 4
    assert TrainState.from_dict(data, "v4").sharded is None
