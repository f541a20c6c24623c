"""gather_in_order: every rank's results back in single-process order, each sample exactly once.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_ordered.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from ddpkit import DistributedSamplerWrapper, gather_in_order
from ddpkit.testing import run_parallel


def predictions(batch: torch.Tensor) -> torch.Tensor:
    """A stand-in for model outputs: two columns derived from the sample index."""
    return torch.stack([batch.double(), batch.double() ** 2 / 7], dim=1)


def _evaluate(n: int, config: dict[str, Any]) -> tuple[bool, int]:
    dataset = TensorDataset(torch.arange(n))
    base: Any = RandomSampler(dataset) if config.get("random") else SequentialSampler(dataset)
    if config.get("batch"):
        base = BatchSampler(base, config["batch"], False)
    sampler = DistributedSamplerWrapper(
        base,
        shuffle=config.get("shuffle", False),
        drop_last=config.get("drop_last", False),
        even_shards=config.get("even", True),
    )
    loader = (
        DataLoader(dataset, batch_sampler=sampler) if config.get("batch") else DataLoader(dataset, 4, sampler=sampler)
    )
    outputs = [predictions(batch[0]) for batch in loader]
    local = torch.cat(outputs) if outputs else torch.empty(0, 2, dtype=torch.float64)
    kind = config.get("kind", "tensor")
    given: Any = {"tensor": local, "array": local.numpy(), "list": [tuple(row) for row in local.tolist()]}[kind]
    ordered = gather_in_order(given, loader if config.get("pass_loader") else sampler)
    reference = DistributedSamplerWrapper(base, 1, 0, even_shards=False)
    wrapped = [i for e in reference for i in (e if isinstance(e, list) else [e])]  # the wrapped sampler's order
    expected = predictions(torch.tensor(wrapped, dtype=torch.int64))
    if config.get("drop_last"):
        seen = {int(row[0]) for row in local.tolist()}
        everyone = [int(x[0]) for x in (ordered.tolist() if kind != "list" else ordered)]
        return sorted(everyone) == sorted(set(everyone)) and all(i in wrapped for i in seen), len(everyone)
    got = torch.as_tensor(np.asarray(ordered, dtype=np.float64))
    return bool(torch.equal(got, expected)) and type(ordered) is type(given), len(ordered)


CASES = [
    {},
    {"even": False},
    {"shuffle": True},
    {"random": True, "shuffle": True, "kind": "array"},
    {"batch": 3, "random": True, "kind": "list"},
    {"batch": 4, "shuffle": True, "even": False},
    {"pass_loader": True, "kind": "list"},
    {"drop_last": True, "shuffle": True},
]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [10, 17, 2])
@pytest.mark.parametrize("config", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_results_come_back_in_single_process_order(world_size: int, n: int, config: dict[str, Any]) -> None:
    results = run_parallel(_evaluate, n, config, world_size=world_size)
    for same, count in results:
        assert same
        if not config.get("drop_last"):
            assert count == n, "each sample exactly once: padded duplicates removed"


def _torch_sampler() -> list[float]:
    dataset = TensorDataset(torch.arange(10))
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=3)
    sampler.set_epoch(2)
    values = torch.cat([batch[0] for batch in DataLoader(dataset, 3, sampler=sampler)]).double()
    return gather_in_order(values * 2, sampler).tolist()


def test_torch_distributed_sampler_results_come_back_in_dataset_order() -> None:
    assert run_parallel(_torch_sampler, world_size=3)[0] == [2.0 * i for i in range(10)]


def _bad(kind: str) -> str:
    rank = dist.get_rank()
    sampler = DistributedSamplerWrapper(SequentialSampler(range(7)))
    if kind != "not iterated":
        list(sampler)
    results: Any = torch.zeros(4 if rank == 0 else 3)
    if kind == "rows" and rank == 1:
        results = torch.zeros(5)
    if kind == "type":
        results = "nope"
    try:
        gather_in_order(results, sampler)
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("rows", "ValueError: gather_in_order: rank 1: rank 1 passed 5 results but its shard holds 4 samples"),
        ("not iterated", "ValueError: gather_in_order: rank 0: the sampler has not been iterated yet"),
        ("type", "TypeError: gather_in_order: rank 0: gather_in_order gathers a tensor, a numpy array or a list"),
    ],
)
def test_bad_input_raises_on_every_rank(kind: str, message: str) -> None:
    for result in run_parallel(_bad, kind):
        assert result.startswith(message)
