"""The retrieval demo: P x K batches, triplets mined over all ranks with their gradient, exact precision@1."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import (
    BalancedBatchSampler,
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


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_ddpkit_demo_retrieval_runs_on_two_processes() -> None:
    command = shutil.which("ddpkit", path=str(Path(sys.executable).parent))
    assert command is not None
    done = subprocess.run(
        [command, "demo", "--task", "retrieval", "--epochs", "3", "--no-progress"],
        capture_output=True, text=True, timeout=170, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    epochs = re.findall(r"^epoch +(\d)/3 +train loss [\d.]+ +validation precision_at_1 [\d.]+ +load\+forward "
                        r"[\d.]+-[\d.]+ ms/batch \(slowest rank [01]\)$", done.stdout, re.M)  # fmt: skip
    assert epochs == ["1", "2", "3"]
    summary = re.search(r"2 processes \(gloo\), 3 epochs, .* precision@1 ([\d.]+) \(untrained ([\d.]+)\)", done.stdout)
    assert summary is not None, done.stdout
    assert float(summary.group(1)) > float(summary.group(2))
