"""Lightning 1.x's DDPPlugin: every method, gradient accumulation equals one process, manual backward syncs.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_ddp_plugin.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddpkit import DDPPlugin, unwrap_model
from ddpkit.testing import run_parallel
from tests.support.ddp_plugin import data

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
