"""Loader rebuilding keeps every argument; OML's patching and build_loader_sampler shard any sampler.

Here, the tests that need no process; the others are in tests/ranks/test_loaders.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
)

from ddpkit import (
    DistributedSamplerWrapper,
    WarningDDP,
    build_loader_sampler,
    check_loaders_is_patched,
    extract_loader_parameters,
    patch_dataloader_to_ddp,
)
from tests.support.loaders import DATA, EveryThirdBatch, rich_loader

OPTIONS = ["num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
           "generator", "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"]  # fmt: skip


def assert_same_options(rebuilt: DataLoader[Any], original: DataLoader[Any]) -> None:
    for name in OPTIONS:
        if hasattr(original, name):
            assert getattr(rebuilt, name) == getattr(original, name), name


def test_extract_loader_parameters_reads_every_argument() -> None:
    loader = rich_loader(batch_size=4, drop_last=True)
    params = extract_loader_parameters(loader)
    assert params["dataset"] is DATA
    assert (params["batch_size"], params["drop_last"]) == (4, True)
    for name in OPTIONS:
        if hasattr(loader, name):
            assert params[name] == getattr(loader, name)
    reduced = extract_loader_parameters(loader, ignore_data_related_parameters=True)
    assert not {"dataset", "batch_size", "drop_last", "sampler", "batch_sampler", "shuffle"} & reduced.keys()
    assert DataLoader(DATA, **reduced).num_workers == 2, "the result rebuilds a loader"


@pytest.mark.parametrize("shuffle", [False, True])
def test_build_loader_sampler_matches_distributed_sampler_for_plain_loaders(shuffle: bool) -> None:
    original = rich_loader(batch_size=4, shuffle=shuffle)
    for rank in range(3):
        loader, sampler = build_loader_sampler(original, shuffle, world_size=3, rank=rank)
        assert isinstance(sampler, DistributedSampler)
        assert loader.sampler is sampler
        reference = DistributedSampler(DATA, 3, rank, shuffle=shuffle)
        for epoch in range(2):
            reference.set_epoch(epoch)
            sampler.set_epoch(epoch)
            assert list(sampler) == list(reference)
        assert (loader.batch_size, loader.drop_last) == (4, False)
        assert_same_options(loader, original)


def test_build_loader_sampler_keeps_custom_samplers_and_batch_samplers() -> None:
    custom = rich_loader(sampler=list(range(22, -1, -1)), batch_size=5, drop_last=True)
    loader, sampler = build_loader_sampler(custom, shuffle=False, world_size=2, rank=1)
    assert sampler.sampler is custom.sampler
    assert list(sampler) == [*range(21, -1, -2), 22]  # the custom order dealt out, padded from its start
    assert (loader.batch_size, loader.drop_last) == (5, True)
    assert_same_options(loader, custom)

    batched = rich_loader(batch_sampler=EveryThirdBatch(23))
    loader, sampler = build_loader_sampler(batched, shuffle=False, world_size=2, rank=0)
    assert loader.batch_sampler is sampler
    assert list(sampler) == [[21, 22], [15, 16, 17], [9, 10, 11], [3, 4, 5]], "whole batches"
    assert_same_options(loader, batched)


def test_build_loader_sampler_without_batching_and_uneven_shards() -> None:
    loader, sampler = build_loader_sampler(DataLoader(DATA, batch_size=None), False, 2, 1, even_shards=False)
    assert loader.batch_size is None
    assert list(sampler) == list(range(1, 23, 2))


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


def test_build_loader_sampler_points_streams_to_stream_loader() -> None:
    with pytest.raises(TypeError, match=r"over an IterableDataset \(Stream\) a sampler.*ddpkit.stream_loader"):
        build_loader_sampler(DataLoader(Stream()), False, 2, 0)


def test_patch_dataloader_to_ddp_without_a_process_group_warns_and_keeps_the_loader() -> None:
    loader = DataLoader(DATA)
    with pytest.warns(WarningDDP, match="'patch_dataloader_to_ddp' function, but the default process group"):
        assert patch_dataloader_to_ddp(loader) is loader


def test_check_loaders_is_patched_accepts_single_loaders_and_torch_samplers() -> None:
    plain = DataLoader(DATA)
    torch_sharded = DataLoader(DATA, sampler=DistributedSampler(DATA, 2, 0))
    ours = DataLoader(DATA, sampler=DistributedSamplerWrapper(SequentialSampler(DATA), 2, 0))
    assert not check_loaders_is_patched(plain)
    assert check_loaders_is_patched([torch_sharded, ours])
    assert not check_loaders_is_patched((ours, plain))
