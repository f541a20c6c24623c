"""The main job: the bundled digits data and `ddpkit demo` training with 2 processes.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_demo.py and
tests/e2e/test_demo.py.
"""

from __future__ import annotations

import torch

from ddpkit.examples.demo import DemoConfig, DemoResult, build_model, train_digits
from ddpkit.examples.digits import digits_datasets
from ddpkit.testing import run_parallel


def test_the_demo_with_a_cosine_schedule_bf16_and_clipping_learns_on_two_ranks() -> None:
    """``ddpkit demo --lr-schedule cosine --precision bf16-mixed --clip 1.0``'s training, in the pool."""
    config = DemoConfig(epochs=3, progress=False, lr_schedule="cosine", precision="bf16-mixed", clip=1.0)
    results = run_parallel(_train, config, world_size=2, timeout=60)
    assert results[0].val_accuracy == results[1].val_accuracy >= 0.9
    assert results[0].train_losses[-1] < results[0].train_losses[0] / 2


def _train(config: DemoConfig) -> DemoResult:
    return train_digits(config)


def test_distributed_validation_accuracy_equals_one_process_on_the_same_weights() -> None:
    """3 ranks, 359 validation samples: padded shards, yet not one duplicate or miss in the count."""
    results = run_parallel(_train, DemoConfig(epochs=2, progress=False), world_size=3, timeout=60)
    result = results[0]
    assert [r.val_correct for r in results] == [result.val_correct] * 3
    assert result.val_total == 359
    model = build_model()
    model.load_state_dict(result.weights)
    _, val = digits_datasets(seed=0)
    images, labels = val.tensors
    with torch.no_grad():
        single = int((model(images).argmax(dim=1) == labels).sum())
    assert result.val_correct == single
