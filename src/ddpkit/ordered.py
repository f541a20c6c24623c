"""``gather_in_order``: the inverse of sharding, for evaluation metrics identical to one process."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ddpkit.collectives.values import Value, gather_values
from ddpkit.loaders import distributed_sampler_of
from ddpkit.process_group import get_rank, get_world_size, is_distributed
from ddpkit.samplers import DistributedSamplerWrapper, EpochLayout

__all__ = ["gather_in_order", "gather_stream_in_order"]


def gather_in_order(
    local_results: torch.Tensor | np.ndarray | list[Any],
    sampler: DistributedSampler[Any] | DataLoader[Any],
    group: dist.ProcessGroup | None = None,
) -> Any:
    """Every rank's results of an epoch, in the order one process would have produced them.

    Each rank passes its results in its own iteration order (one row or list
    item per sample it processed, padded duplicates included, as its loader
    yielded them). Every rank gets back the whole epoch's results in the order
    the wrapped sampler produced the samples, each sample exactly once: padded
    duplicates are removed, and with ``drop_last`` only the samples that were
    processed remain. Metrics computed from the result therefore equal the
    single-process metrics exactly. Costs one uneven gather plus O(N) local work;
    no indices travel. Every rank of ``group`` must call it.

    Args:
        local_results: a tensor or numpy array with one row per sample (any
            trailing shape), or a list with one item per sample.
        sampler: the sampler that sharded the epoch, after iterating it: a
            :class:`~ddpkit.DistributedSamplerWrapper` (also as a batch sampler;
            results are per sample), a ``torch.utils.data.DistributedSampler``
            (results in dataset index order), or the ``DataLoader`` holding either.
        group: the process group the sampler's ranks form; default the whole world.

    Returns:
        A tensor (on ``local_results``' device), numpy array or list, of the same
        kind as ``local_results``, with one row per sample of the epoch. Without a
        process group: ``local_results`` put in the sampler's order.

    Raises:
        ValueError: a rank's row count is not the number of samples its shard
            holds, the sampler has not been iterated yet, or its ``num_replicas``
            is not the group's size (on every rank, naming the counts).
        TypeError: ``local_results`` is not a tensor, array or list (on every rank).
        CollectiveMismatchError: ranks passed different kinds, dtypes or trailing shapes.
    """
    return gather_each_in_order((local_results,), sampler, group)[0]


def gather_each_in_order(
    results: tuple[Any, ...], sampler: DistributedSampler[Any] | DataLoader[Any], group: dist.ProcessGroup | None = None
) -> tuple[Any, ...]:
    """:func:`gather_in_order` of several results of the same samples (predictions and targets, say) in one
    exchange; each one's row count must be the shard's."""
    distributed = is_distributed()
    world_size, rank = (get_world_size(group), get_rank(group)) if distributed else (1, 0)
    value: dict[Any, Value] | BaseException
    try:
        layout, own_rank = _layout_of(sampler)
        if layout.world_size != world_size and distributed:
            raise ValueError(
                f"the sampler shards over num_replicas={layout.world_size} but the process group has {world_size} ranks"
            )
        if distributed and own_rank != rank:
            raise ValueError(f"the sampler is for rank {own_rank} but this is rank {rank} of the process group")
        expected = len(layout.rank_items(own_rank)[0])
        for local_results in results:
            rows = _rows(local_results)
            if rows != expected:
                raise ValueError(
                    f"rank {own_rank} passed {rows} results but its shard holds {expected} samples in the last epoch "
                    "(pass one row per sample, padded duplicates included; do not drop the last batch)"
                )
        value = {index: Value(local_results, "results") for index, local_results in enumerate(results)}
    except (TypeError, ValueError) as exc:
        if not distributed:
            raise
        value = exc
    if not distributed:
        # One process holding a shard of W: order its own items (a full epoch only when W == 1).
        return tuple(_place(each, [(*layout.rank_items(own_rank), each)], layout) for each in results)
    parts = gather_values("gather_in_order", value, group).parts
    return tuple(
        _place(each, [(*layout.rank_items(r), part) for r, part in enumerate(parts[index])], layout)
        for index, each in enumerate(results)
    )


def gather_stream_in_order(
    local_results: torch.Tensor | np.ndarray | list[Any], keys: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Any:
    """Every rank's results over a stream, in stream order, each item once: ``gather_in_order`` for streams.

    Each rank passes its results (one row or list item per item it processed)
    and their keys, as :meth:`~ddpkit.StreamDataLoader.iter_tagged` gave them
    (``keys``, concatenated). Every rank gets
    back all results ordered by ``(shard, offset)``, the order one process
    reading the stream sees them; an item that occurs more than once (the
    padding of ``ends="even"``) is kept once. One uneven gather plus a sort.
    Every rank of ``group`` must call it.

    Args:
        local_results: a tensor or numpy array with one row per item, or a list with one entry per item.
        keys: ``(items, k)`` int64 with ``k >= 2``: shard and offset in the shard first.
        group: the process group; default the whole world.

    Returns:
        A tensor (on ``local_results``' device), numpy array or list, of the
        same kind as ``local_results``, one row per distinct key.

    Raises:
        ValueError: ``keys`` is not ``(items, k >= 2)`` integers, or its row
            count differs from the results' (on every rank, naming the counts).
        TypeError: ``local_results`` is not a tensor, array or list (on every rank).
        CollectiveMismatchError: ranks passed different kinds, dtypes or trailing shapes.
    """
    return gather_each_stream_in_order((local_results,), keys, group)[0]


def gather_each_stream_in_order(
    results: tuple[Any, ...], keys: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[Any, ...]:
    """:func:`gather_stream_in_order` of several results of the same items, in one exchange."""
    distributed = is_distributed()
    value: dict[Any, Value] | BaseException
    try:
        for local_results in results:
            rows = _rows(local_results)
            if keys.dim() != 2 or keys.shape[1] < 2 or keys.is_floating_point() or keys.shape[0] != rows:
                raise ValueError(
                    f"rank {get_rank(group) if distributed else 0} passed {rows} results and keys of shape "
                    f"{tuple(keys.shape)} ({keys.dtype}); keys must be ({rows}, k >= 2) integers: shard, offset, ..."
                )
        value = {index: Value(each, "results") for index, each in enumerate(results)}
        value["keys"] = Value(keys[:, :2].to("cpu", torch.int64), "keys")
    except (TypeError, ValueError) as exc:
        if not distributed:
            raise
        value = exc
    if distributed:
        gathered = gather_values("gather_stream_in_order", value, group)
        joined, all_keys = [gathered.join(index) for index in range(len(results))], gathered.join("keys").cpu()
    else:
        joined, all_keys = list(results), keys[:, :2].to("cpu", torch.int64)
    return tuple(_by_key(each, local, all_keys) for each, local in zip(joined, results, strict=True))


def _by_key(results: Any, like: Any, all_keys: torch.Tensor) -> Any:
    """``results``' rows sorted by ``all_keys`` (shard, offset), each key's first row only."""
    order = np.lexsort((all_keys[:, 1].numpy(), all_keys[:, 0].numpy()))
    ordered_keys = all_keys.numpy()[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = np.any(ordered_keys[1:] != ordered_keys[:-1], axis=1)
    keep = order[first]
    if isinstance(results, list):
        return [results[i] for i in keep.tolist()]
    if isinstance(results, np.ndarray):
        return results[keep]
    index = torch.from_numpy(keep)
    return results.to(like.device)[index.to(like.device)]


def _layout_of(sampler: Any) -> tuple[EpochLayout, int]:
    """The last epoch's layout of ``sampler`` and the rank it serves."""
    if isinstance(sampler, DataLoader):
        found = distributed_sampler_of(sampler)
        if found is None:
            kind = type(sampler.sampler).__name__
            raise TypeError(
                f"gather_in_order needs a distributed sampler; this DataLoader has a {kind} "
                "(shard it with ddpkit.build_loader_sampler or patch_dataloader_to_ddp)"
            )
        sampler = found
    if isinstance(sampler, DistributedSamplerWrapper):
        if sampler.last_layout is None:
            raise ValueError("the sampler has not been iterated yet: gather_in_order inverts the epoch it produced")
        return sampler.last_layout, sampler.rank
    if isinstance(sampler, DistributedSampler):  # torch's own: rebuild its layout
        n = len(sampler.dataset)  # type: ignore[arg-type]
        permutation = None
        if sampler.shuffle:
            generator = torch.Generator().manual_seed(sampler.seed + sampler.epoch)
            permutation = torch.randperm(n, generator=generator)
        return EpochLayout(n, sampler.num_replicas, "drop" if sampler.drop_last else "pad", permutation), sampler.rank
    raise TypeError(f"gather_in_order needs a DistributedSampler or a DataLoader, got {type(sampler).__name__}")


def _rows(results: Any) -> int:
    if isinstance(results, (torch.Tensor, np.ndarray)):
        if results.ndim == 0:
            raise TypeError("gather_in_order needs one row per sample; got a 0-d tensor or array")
        return int(results.shape[0])
    if isinstance(results, list):
        return len(results)
    raise TypeError(f"gather_in_order gathers a tensor, a numpy array or a list; got {type(results).__name__}")


def _place(like: Any, pieces: list[tuple[torch.Tensor, torch.Tensor, Any]], layout: EpochLayout) -> Any:
    """Put every first occurrence at its position in the wrapped order; keep only positions that occurred."""
    size = layout.items()
    covered = torch.zeros(size, dtype=torch.bool)
    for positions, first, _ in pieces:
        covered[positions[first]] = True
    if isinstance(like, list):
        slots: list[Any] = [None] * size
        for positions, first, part in pieces:
            for position, keep, item in zip(positions.tolist(), first.tolist(), part, strict=True):
                if keep:
                    slots[position] = item
        return [slots[p] for p in torch.nonzero(covered).flatten().tolist()]
    if isinstance(like, np.ndarray):
        out_array = np.empty((size, *like.shape[1:]), dtype=like.dtype)
        for positions, first, part in pieces:
            out_array[positions[first].numpy()] = np.asarray(part)[first.numpy()]
        return out_array[covered.numpy()]
    out = torch.empty((size, *like.shape[1:]), dtype=like.dtype, device=like.device)
    for positions, first, part in pieces:
        index = positions[first].to(like.device)
        out[index] = part.to(like.device)[first.to(like.device)]
    return out[covered.to(like.device)]
