"""What several test modules share: one job."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from tests.e2e import one_job

SAMPLES = 1438  # the digits' training split


#: Items a rank may repeat in an epoch: DistributedSampler-style padding, or a stream's padding batches.
PADDING_ALLOWED = 4 * one_job.BATCH


def check_case(results: list[dict[str, Any]], reference: list[float] | None = None) -> None:
    """The DDP invariants of one case, given each rank's result."""
    results = sorted(results, key=lambda result: int(result["rank"]))
    case = f"{results[0]['entry']} on {results[0]['data']}"
    assert [r["rank"] for r in results] == [0, 1], case
    assert [r["world_size"] for r in results] == [2, 2], case
    seen = Counter(index for result in results for index in result["seen"])
    assert set(seen) == set(range(SAMPLES)), f"{case}: samples never trained on"
    repeated = sum(seen.values()) - SAMPLES
    assert repeated <= PADDING_ALLOWED, f"{case}: {repeated} samples used twice (independent copies?)"
    assert results[0]["printed"].strip(), f"{case}: rank 0 printed nothing"
    assert results[1]["printed"] == "", f"{case}: rank 1 printed {results[1]['printed']!r}"
    assert [r["writes"] > 0 for r in results] == [True, False], f"{case}: checkpoint writes per rank"
    final = [torch.tensor(r["weights"]) for r in results]
    torch.testing.assert_close(final[1], final[0], rtol=0, atol=1e-6, msg=f"{case}: ranks disagree")
    if reference is not None:
        torch.testing.assert_close(final[0], torch.tensor(reference), rtol=0, atol=1e-5, msg=f"{case}: weights")


def _as_in_the_ddp_tutorial(entry: str, data: str, out_dir: str) -> dict[str, Any]:
    """A case in a pool worker as in processes that PyTorch's DDP tutorial starts: a group made with
    ``init_process_group(rank=, world_size=, init_method="file://...")``, no ``RANK``/``WORLD_SIZE``
    variables, DataLoader workers spawned (they inherit nothing of the rank's group)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)  # the pool restores them after the task
    return one_job.run_case(entry, data, out_dir, "spawn")
