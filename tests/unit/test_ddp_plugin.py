"""Lightning 1.x's DDPPlugin: every method, gradient accumulation equals one process, manual backward syncs.

Here, the tests that need no process; the others are in tests/ranks/test_ddp_plugin.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel

from ddpkit import DDPPlugin, LocalEnvironment, is_distributed, move_data_to_device, unwrap_model
from tests.helpers import free_port

# --- move_data_to_device and unwrap_model (no processes) -----------------------------------------------

Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass(frozen=True)
class Batch:
    images: torch.Tensor
    names: list[str]
    derived: torch.Tensor = dataclasses.field(init=False, default_factory=lambda: torch.zeros(1))


def test_move_data_to_device_handles_nested_containers_and_leaves_the_rest() -> None:
    counts: defaultdict[str, Any] = defaultdict(list, {"t": torch.ones(2)})
    batch = {
        "x": torch.ones(2),
        "pair": Pair(torch.zeros(1), "label"),
        "list": [torch.ones(1), 3, None],
        "tuple": (torch.ones(1),),
        "ordered": OrderedDict(a=torch.ones(1)),
        "counts": counts,
        "data": Batch(torch.ones(3), ["a"]),
    }
    moved = move_data_to_device(batch, "meta")
    assert moved["x"].device.type == "meta"
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].left.is_meta
    assert moved["pair"].right == "label"
    assert moved["list"][0].is_meta
    assert moved["list"][1:] == [3, None]
    assert isinstance(moved["tuple"], tuple)
    assert moved["tuple"][0].is_meta
    assert isinstance(moved["ordered"], OrderedDict)
    assert moved["ordered"]["a"].is_meta
    assert isinstance(moved["counts"], defaultdict)
    assert moved["counts"].default_factory is list
    assert isinstance(moved["data"], Batch)
    assert moved["data"].images.is_meta
    assert moved["data"].derived.is_meta
    assert moved["data"].names[0] is batch["data"].names[0], "non-tensors are left as they are"
    assert batch["x"].device.type == "cpu", "the input is not changed"
    same = torch.ones(1)
    assert move_data_to_device(same, "cpu") is same


def test_unwrap_model_removes_data_parallel_and_compile_wrappers() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap_model(inner) is inner
    assert unwrap_model(DataParallel(inner)) is inner
    assert unwrap_model(torch.compile(DataParallel(inner))) is inner


def test_on_before_forward_moves_inputs_to_the_models_device() -> None:
    model = nn.Linear(2, 2, device="meta")
    args = DDPPlugin().on_before_forward(model, torch.ones(2), {"mask": torch.ones(1)}, "text")
    assert args[0].is_meta
    assert args[1]["mask"].is_meta
    assert args[2] == "text"
    assert DDPPlugin().on_before_forward(nn.ReLU(), torch.ones(1))[0].device.type == "cpu", "no parameters: unchanged"


def test_on_before_forward_finds_the_device_where_model_parameters_does() -> None:
    """The device lookup runs before every forward, so it walks the modules itself: it must find the tensor
    ``next(model.parameters())`` (else ``next(model.buffers())``) finds, however deep."""
    from ddpkit.parallel_plugin import _device_of

    class OwnFirst(nn.Module):  # its own parameter comes before its child's, whatever the registration order
        def __init__(self) -> None:
            super().__init__()
            self.child = nn.Linear(2, 2, device="meta")
            self.scale = nn.Parameter(torch.ones(1))

    models = [
        nn.Sequential(nn.ReLU(), nn.Sequential(nn.Identity(), nn.Linear(2, 2, device="meta"))),
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta")),
        OwnFirst(),
        nn.Sequential(nn.ReLU(), nn.BatchNorm1d(2, affine=False, device="meta")),  # buffers only
    ]
    for model in models:
        expected = next(model.parameters(), None)
        expected = expected if expected is not None else next(model.buffers())
        assert _device_of(model) == expected.device, model
    assert [_device_of(model).type for model in models] == ["meta", "cpu", "cpu", "meta"]  # type: ignore[union-attr]
    assert _device_of(nn.ReLU()) is None


def test_single_process_helpers() -> None:
    plugin = DDPPlugin()
    assert not plugin.is_running_single_process_per_device
    plugin.device_ids = [0]
    assert plugin.is_running_single_process_per_device
    plugin.device_ids = [0, 1]
    assert not plugin.is_running_single_process_per_device
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1, momentum=0.9)
    assert plugin.optimizer_state(optimizer) == optimizer.state_dict()
    assert plugin.on_after_setup_optimizers(None) is None
    assert plugin.on_after_manual_backward(nn.Linear(1, 1)) is None
    assert plugin.distributed_sampler_kwargs({"shuffle": True}) == {"shuffle": True}
    assert plugin.data_parallel_group is None
    with plugin.block_backward_sync(nn.Linear(1, 1)):
        pass  # a plain module: nothing to block


def test_init_ddp_connection_sets_the_variables_and_a_group() -> None:
    plugin = DDPPlugin()
    environment = LocalEnvironment({"MASTER_PORT": str(free_port())})

    class Trainer:
        on_gpu = False

    plugin.init_ddp_connection(Trainer(), environment, global_rank=0, world_size=1)
    assert is_distributed()
    assert dist.get_backend() == "gloo"
    assert (os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("1", "127.0.0.1")
    assert os.environ["MASTER_PORT"] == str(environment.master_port())
    plugin.init_ddp_connection(None, environment, 0, 1)  # idempotent
    assert plugin.data_parallel_group is dist.group.WORLD


# --- with a process group (pool) --------------------------------------------------------------------------


def test_configure_ddp_without_a_process_group_says_how_to_create_one() -> None:
    """Before, torch's raw 'Default process group has not been initialized' came out of DDP's constructor."""
    with pytest.raises(ValueError, match=r"needs a process group: call ddpkit.init_dist_connection\(\) first"):
        DDPPlugin().configure_ddp(nn.Linear(1, 1), None)
