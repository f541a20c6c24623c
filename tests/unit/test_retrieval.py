"""The retrieval demo: P x K batches, triplets mined over all ranks with their gradient, exact precision@1.

Here, the tests that need no process; the others are in tests/ranks/test_retrieval.py and
tests/e2e/test_retrieval.py.
"""

from __future__ import annotations

import pytest
import torch

from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import (
    BalancedBatchSampler,
    precision_at_1,
)

B, D = 12, 5  # per-rank batch and embedding size


def test_balanced_batches_hold_p_classes_of_k_distinct_samples() -> None:
    train, _ = digits_datasets(seed=0)
    labels = train.tensors[1]
    sampler = BalancedBatchSampler(labels, classes_per_batch=8, samples_per_class=4)
    sampler.generator = torch.Generator().manual_seed(0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == len(labels) // 32
    for batch in batches:
        assert len(set(batch)) == 32
        counts = torch.bincount(labels[batch], minlength=10)
        assert sorted(counts.tolist()) == [0, 0] + [4] * 8
    with pytest.raises(ValueError, match="P x K = 11 x 4 needs at least 11 classes"):
        BalancedBatchSampler(labels, 11, 4)


def test_precision_at_1_leaves_the_query_out() -> None:
    points = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]]), dim=1)
    assert precision_at_1(points, torch.tensor([0, 0, 1, 1])) == 1.0
    assert precision_at_1(points, torch.tensor([0, 1, 0, 1])) == 0.0
