"""The retrieval demo: P x K batches, triplets mined over all ranks with their gradient, exact precision@1.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_retrieval.py and
tests/e2e/test_retrieval.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import (
    EmbeddingNet,
    RetrievalConfig,
    RetrievalResult,
    precision_at_1,
    run_retrieval_demo,
    triplet_loss,
)
from ddpkit.testing import run_parallel

B, D = 12, 5  # per-rank batch and embedding size


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s unit embeddings and labels (4 classes, shared between the ranks)."""
    generator = torch.Generator().manual_seed(rank)
    embeddings = torch.nn.functional.normalize(torch.randn(B, D, generator=generator), dim=1)
    return embeddings, torch.arange(B) % 4


def _loss_and_gradient() -> tuple[float, torch.Tensor]:
    embeddings, labels = _batch(dist.get_rank())
    embeddings.requires_grad_(True)
    loss = triplet_loss(embeddings, labels, margin=0.5)
    loss.backward()  # type: ignore[no-untyped-call]
    assert embeddings.grad is not None
    return float(loss.detach()), embeddings.grad


def test_triplets_across_ranks_equal_one_batch_of_both_with_the_gradient_sent_home() -> None:
    ranks = run_parallel(_loss_and_gradient, world_size=2)
    (e0, l0), (e1, l1) = _batch(0), _batch(1)
    everything = torch.cat([e0, e1]).requires_grad_(True)
    single = triplet_loss(everything, torch.cat([l0, l1]), margin=0.5)
    single.backward()  # type: ignore[no-untyped-call]
    assert everything.grad is not None
    assert (ranks[0][0] + ranks[1][0]) / 2 == pytest.approx(float(single.detach()), rel=1e-6)
    # Each rank's embeddings get the gradient of every rank's loss; DDP's mean over 2 ranks makes it the
    # single-process gradient.
    assert torch.allclose(ranks[0][1] / 2, everything.grad[:B], atol=1e-6)
    assert torch.allclose(ranks[1][1] / 2, everything.grad[B:], atol=1e-6)
    alone = _batch(0)[0].requires_grad_(True)
    triplet_loss(alone, l0, margin=0.5).backward()  # type: ignore[no-untyped-call]
    assert not torch.allclose(alone.grad, ranks[0][1] / 2, atol=1e-3), "the other rank's samples matter"  # type: ignore[arg-type]


def _train(epochs: int) -> RetrievalResult:
    return run_retrieval_demo(0, RetrievalConfig(epochs=epochs, progress=False))


def test_two_ranks_learn_and_report_the_single_process_precision_exactly() -> None:
    results = run_parallel(_train, 3, world_size=2, timeout=60)
    result = results[0]
    assert results[1].precision_at_1 == result.precision_at_1
    assert result.train_losses[-1] < result.train_losses[0] / 2
    assert result.precision_at_1 > result.initial_precision_at_1
    model = EmbeddingNet()
    model.load_state_dict(result.weights)
    _, val = digits_datasets(seed=0)
    with torch.no_grad():
        assert precision_at_1(model(val.tensors[0]), val.tensors[1]) == result.precision_at_1
