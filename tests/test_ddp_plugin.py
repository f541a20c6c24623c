"""DDPPlugin (seed 002): every method, gradient accumulation equals one process, manual backward syncs."""

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
from ddpkit.testing import run_parallel

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
    environment = LocalEnvironment({"MASTER_PORT": str(_free_port())})

    class Trainer:
        on_gpu = False

    plugin.init_ddp_connection(Trainer(), environment, global_rank=0, world_size=1)
    assert is_distributed()
    assert dist.get_backend() == "gloo"
    assert (os.environ["WORLD_SIZE"], os.environ["MASTER_ADDR"]) == ("1", "127.0.0.1")
    assert os.environ["MASTER_PORT"] == str(environment.master_port())
    plugin.init_ddp_connection(None, environment, 0, 1)  # idempotent
    assert plugin.data_parallel_group is dist.group.WORLD


def _free_port() -> int:
    from ddpkit.environments import find_free_port

    return find_free_port()


# --- with a process group (pool) --------------------------------------------------------------------------


def make_model(unused: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers: dict[str, nn.Module] = {"a": nn.Linear(4, 3), "b": nn.Linear(3, 2)}
    if unused:
        layers["unused"] = nn.Linear(4, 2)
    return nn.ModuleDict(layers)


def forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    inner = unwrap_model(model)
    return inner["b"](torch.tanh(inner["a"](x)))  # type: ignore[operator]


class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.layers = make_model(unused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self.layers, x)


def data(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)) for _ in range(steps)]


def _configure() -> dict[str, Any]:
    plugin = DDPPlugin(broadcast_buffers=False, bucket_cap_mb=1)
    model = plugin.configure_ddp(Net(), device_ids=None)
    return {
        "type": type(model).__name__,
        "find_unused": model.find_unused_parameters,
        "broadcast_buffers": model.broadcast_buffers,
        "kwargs": plugin._ddp_kwargs,
        "unwrapped": type(plugin.get_model_from_plugin(model)).__name__,
        "sampler": plugin.distributed_sampler_kwargs({"rank": 5}),
        "group": plugin.data_parallel_group is dist.group.WORLD,
        "single": plugin.is_running_single_process_per_device,
    }


def test_configure_ddp_forwards_the_constructor_arguments() -> None:
    rank0, rank1 = run_parallel(_configure)
    assert (rank0["type"], rank0["find_unused"], rank0["broadcast_buffers"]) == (
        "DistributedDataParallel",
        False,
        False,
    )
    assert rank0["kwargs"] == {"broadcast_buffers": False, "bucket_cap_mb": 1, "find_unused_parameters": False}
    assert rank0["unwrapped"] == "Net"
    assert rank1["sampler"] == {"rank": 5}, "Lightning 1.x's plugin returns its input as it is"
    assert (rank1["group"], rank1["single"]) == (True, False)


def _accumulate(micro_steps: int) -> dict[str, Any]:
    rank = dist.get_rank()
    plugin = DDPPlugin()
    model = plugin.configure_ddp(Net(), None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = data(rank, micro_steps)
    local_grads = []
    for step, (x, y) in enumerate(batches):
        if step < micro_steps - 1:
            with plugin.block_backward_sync(model):  # forward and backward inside: DDP decides at the forward
                (nn.functional.mse_loss(model(*plugin.on_before_forward(model, x)), y) / micro_steps).backward()
            local_grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        else:
            (nn.functional.mse_loss(model(*plugin.on_before_forward(model, x)), y) / micro_steps).backward()
    synced = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    optimizer.step()
    return {"local": local_grads, "synced": synced, "params": [p.detach().clone() for p in model.parameters()]}


def test_accumulation_without_sync_equals_one_process_over_the_same_data() -> None:
    micro_steps = 3
    rank0, rank1 = run_parallel(_accumulate, micro_steps)
    differs = [not torch.equal(a, b) for a, b in zip(rank0["local"][0], rank1["local"][0], strict=True)]
    assert all(differs), "inside block_backward_sync each rank keeps its own gradient"
    assert all(torch.equal(a, b) for a, b in zip(rank0["synced"], rank1["synced"], strict=True))

    # One process, all 2 x 3 micro-batches, the same average.
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    everything = data(0, micro_steps) + data(1, micro_steps)
    for x, y in everything:
        (nn.functional.mse_loss(model(x), y) / len(everything)).backward()
    optimizer.step()
    for ddp, single in zip(rank0["params"], model.parameters(), strict=True):
        assert torch.allclose(ddp, single.detach(), atol=1e-6)


def _manual_backward(find_unused: bool, prepare: bool) -> list[list[float]]:
    rank = dist.get_rank()
    plugin = DDPPlugin(find_unused_parameters=find_unused)
    model = plugin.configure_ddp(Net(unused=find_unused), None)
    grads = []
    for step in range(2):
        model.zero_grad()
        x = torch.full((3, 4), float(rank + 1 + step))
        loss = model.module(x).sum()  # computed past the DDP wrapper, as a training_step may be
        if prepare:
            plugin.on_before_manual_backward(model, loss)
        loss.backward()
        plugin.on_after_manual_backward(model)
        grads.append(model.module.layers["a"].weight.grad.flatten().tolist())  # type: ignore[union-attr, index]
    return grads


@pytest.mark.parametrize("find_unused", [False, True])
def test_manual_backward_is_synchronised_with_the_plugins_hooks(find_unused: bool) -> None:
    rank0, rank1 = run_parallel(_manual_backward, find_unused, True)
    assert rank0 == rank1, "gradients agree across ranks"
    unsynced0, unsynced1 = run_parallel(_manual_backward, find_unused, False)
    assert unsynced0 != unsynced1, "without the hook they silently do not (what the hook prevents)"


def _zero_state() -> tuple[int, int]:
    from torch.distributed.optim import ZeroRedundancyOptimizer  # its import warns about torch.jit

    plugin = DDPPlugin()
    model = plugin.configure_ddp(Net(), None)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    state = plugin.optimizer_state(optimizer)
    return len(state.get("state", {})), len(list(model.parameters()))


def test_optimizer_state_consolidates_a_sharded_optimizer_on_rank_zero() -> None:
    (full, parameters), (empty, _) = run_parallel(_zero_state)
    assert (full, empty) == (parameters, 0)


def test_configure_ddp_without_a_process_group_says_how_to_create_one() -> None:
    """Before, torch's raw 'Default process group has not been initialized' came out of DDP's constructor."""
    with pytest.raises(ValueError, match=r"needs a process group: call ddpkit.init_dist_connection\(\) first"):
        DDPPlugin().configure_ddp(nn.Linear(1, 1), None)
