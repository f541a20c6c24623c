"""A sharded model's state in memory as this rank's shards (private): what a recovering fault-tolerant replica
group of a sharded model takes, rank ``r`` from rank ``r`` of a healthy group, which holds the same shards.

Plain tensors and values only (each ``DTensor`` as its local shard): the state travels over the replica groups'
pickle-free channel, and is put back into the receiving rank's own shards with no collective.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ddpkit._gradients import local_tensor
from ddpkit.parallel_plugin import unwrap_model
from ddpkit.process_group import get_rank, get_world_size

__all__ = ["is_local_shards", "load_local_shards", "local_shards"]

#: The key of the weights' dict that marks them as one rank's shards (no ``state_dict`` name has an ``@``).
MARK = "@local_shards"


def local_shards(model: nn.Module, parameters: Mapping[str, torch.Tensor], optimizer: Optimizer
                 ) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """``(weights, optimizer state)`` of this rank: ``parameters`` (the sharded parameters by name, as sharding
    made them) and ``model``'s buffers, and ``optimizer.state_dict()``, each sharded tensor replaced by this rank's
    shard (buffers whole), the weights marked with this rank and the process group's size. No collective; safe
    from another thread while the model computes (FSDP puts each unit's whole weights in its modules while it
    computes: the sharded parameters are read from ``parameters``, not from the modules)."""
    named = _named_tensors(model, parameters)
    weights: dict[str, Any] = {name: local_tensor(t.detach()) for name, t in named}
    weights[MARK] = {"rank": get_rank(), "ranks": get_world_size()}
    saved = optimizer.state_dict()
    state = {
        number: {key: local_tensor(v) if isinstance(v, torch.Tensor) else v for key, v in values.items()}
        for number, values in saved["state"].items()
    }
    return weights, {"state": state, "param_groups": saved["param_groups"]}


def is_local_shards(weights: dict[str, Any]) -> bool:
    """Whether ``weights`` are one rank's shards (:func:`local_shards`)."""
    return MARK in weights


def load_local_shards(model: nn.Module, parameters: Mapping[str, torch.Tensor], optimizer: Optimizer,
                      weights: dict[str, Any], optimizer_state: dict[str, Any]) -> None:  # fmt: skip
    """Copy :func:`local_shards` of the same rank of another process group of the same size into this rank's
    shards (``parameters``, ``model``'s buffers) and ``optimizer`` (no collective).

    Raises:
        ValueError: the shards are another rank's, or of a process group of another size (the two replica
            groups shard the model differently): the message says which.
    """
    mark, rank, ranks = weights[MARK], get_rank(), get_world_size()
    if (mark.get("rank"), mark.get("ranks")) != (rank, ranks):
        raise ValueError(
            f"rank {rank} of a replica group of {ranks} ranks was sent the model's shards of rank {mark.get('rank')} "
            f"of a group of {mark.get('ranks')}: every replica group of a fault-tolerant job that shards its model "
            "needs the same number of ranks (start every group with the same --group-size, or the same number of "
            "processes on every node)"
        )
    with torch.no_grad():
        for name, target in _named_tensors(model, parameters):
            local_tensor(target).copy_(weights[name])
    held = [p for group in optimizer.param_groups for p in group["params"]]
    state = {
        number: {key: _shard_of(held[int(number)], v) for key, v in values.items()}
        for number, values in optimizer_state["state"].items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_state["param_groups"]})


def _shard_of(parameter: torch.Tensor, value: Any) -> Any:
    """``value`` as the ``DTensor`` that ``parameter`` (sharded) holds it in: a local shard of its shape made a
    ``DTensor`` of ``parameter``'s mesh and placements; anything else (a step count) as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(parameter, DTensor) or not isinstance(value, torch.Tensor):
        return value
    if value.shape != parameter.to_local().shape or not value.dim():
        return value
    return DTensor.from_local(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                              run_check=False, shape=parameter.shape, stride=parameter.stride())  # fmt: skip


def _named_tensors(model: nn.Module, parameters: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """``parameters``, then ``model``'s buffers, by name: the tensors themselves (a sharded model's ``state_dict``
    may hold copies)."""
    yield from parameters.items()
    yield from unwrap_model(model).named_buffers()
