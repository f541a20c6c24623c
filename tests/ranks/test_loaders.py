"""Loader rebuilding keeps every argument; OML's patching and build_loader_sampler shard any sampler.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_loaders.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from ddpkit import (
    DDPSamplerWrapper,
    check_loaders_is_patched,
    patch_dataloader_to_ddp,
)
from ddpkit.testing import run_parallel
from tests.support.loaders import EveryThirdBatch, rich_loader

DATA = TensorDataset(torch.arange(23))


OPTIONS = ["num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
           "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"]  # fmt: skip


def _patched(kind: str) -> dict[str, Any]:
    loaders = {
        "auto": lambda: rich_loader(batch_size=4, sampler=RandomSampler(DATA)),
        "explicit BatchSampler": lambda: rich_loader(batch_sampler=BatchSampler(SequentialSampler(DATA), 4, True)),
        "custom batch sampler": lambda: rich_loader(batch_sampler=EveryThirdBatch(23)),
        "no batching": lambda: DataLoader(DATA, batch_size=None, sampler=SequentialSampler(DATA)),
    }
    original = loaders[kind]()
    patched = patch_dataloader_to_ddp(original)
    wrapper = patched.batch_sampler if isinstance(patched.batch_sampler, DDPSamplerWrapper) else patched.sampler
    same = all(getattr(patched, n) == getattr(original, n) for n in OPTIONS if hasattr(original, n))
    return {
        "wrapper": type(wrapper).__name__,
        "wraps": type(wrapper.sampler).__name__,
        "batch": (patched.batch_size, patched.drop_last),
        "entries": [list(e) if isinstance(e, list) else e for e in wrapper],
        "same options": same,
        "patched": check_loaders_is_patched([patched]),
        "original patched": check_loaders_is_patched(original),
    }


def test_patch_dataloader_to_ddp_shards_the_sampler_of_a_plain_batch_sampler() -> None:
    rank0, rank1 = run_parallel(_patched, "auto")
    assert (rank0["wrapper"], rank0["wraps"], rank0["batch"]) == ("DDPSamplerWrapper", "RandomSampler", (4, False))
    everything = rank0["entries"] + rank1["entries"]
    assert (set(everything), len(everything)) == (set(range(23)), 24), "every item, one padded repeat"
    assert (rank0["same options"], rank0["patched"], rank0["original patched"]) == (True, True, False)


def test_patch_dataloader_to_ddp_rebatches_an_explicit_batch_sampler() -> None:
    """The BatchSampler's own sampler is sharded, with its batch size and drop_last (loader.batch_size is None)."""
    rank0, rank1 = run_parallel(_patched, "explicit BatchSampler")
    assert (rank0["wraps"], rank0["batch"]) == ("SequentialSampler", (4, True))
    assert rank0["entries"] == list(range(0, 23, 2))
    assert rank1["entries"] == [*range(1, 23, 2), 0]


def test_patch_dataloader_to_ddp_keeps_custom_batches_whole() -> None:
    rank0, rank1 = run_parallel(_patched, "custom batch sampler")
    assert rank0["wraps"] == "EveryThirdBatch"
    assert rank0["entries"] == [[21, 22], [15, 16, 17], [9, 10, 11], [3, 4, 5]]
    assert rank1["entries"] == [[18, 19, 20], [12, 13, 14], [6, 7, 8], [0, 1, 2]]


def test_patch_dataloader_to_ddp_without_automatic_batching() -> None:
    rank0, _ = run_parallel(_patched, "no batching")
    assert (rank0["batch"], rank0["entries"]) == ((None, False), list(range(0, 23, 2)))
