"""What several test modules share: elastic."""

from __future__ import annotations

import argparse

import torch

from ddpkit.examples.elastic import (
    elastic_train_loop,
)
from ddpkit.examples.retrieval import BalancedBatchSampler
from ddpkit.samplers import DistributedSamplerWrapper
from tests.builders import digits_loop


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _refused(global_batch: int, accumulation: int = 1, drop_last: bool = False) -> str:
    loop = digits_loop(32, shuffle=False, drop_last=drop_last, validation_batch_size=None,
                       global_batch_size=global_batch)  # fmt: skip
    try:
        loop.fit(1, grad_accumulation=accumulation)
    except ValueError as error:
        return str(error)
    return "trained"


def _expected_epochs(args: argparse.Namespace, epochs: int) -> dict[int, list[int]]:
    """Each epoch's samples as ddpkit deals the training loader out (one rank, no padding)."""
    loader = elastic_train_loop(args).train_loader
    if args.sampler == "items":
        return {epoch: list(range(len(loader.dataset))) for epoch in range(epochs)}  # type: ignore[arg-type]
    assert isinstance(loader.batch_sampler, BalancedBatchSampler)
    wrapper = DistributedSamplerWrapper(loader.batch_sampler, 1, 0, seed=args.seed, even_shards=False)
    expected = {}
    for epoch in range(epochs):
        wrapper.set_epoch(epoch)
        expected[epoch] = sorted(i for batch in wrapper for i in batch)
    return expected
