"""Benchmark sharding and ordered gathering against torch's own, measured in the same run.

    python bench/samplers.py [--items 1000000] [--reps 5]

1. Iterate one epoch of a 1,000,000-item ``RandomSampler`` wrapped in
   :class:`ddpkit.DistributedSamplerWrapper` (rank 0 of 2) against
   ``DistributedSampler(shuffle=True)``: best wall time of ``--reps`` runs, and
   peak memory, measured as the growth of the peak resident set size in a fresh
   process per variant (``tracemalloc`` would miss tensors). Target: <= 2.0x the
   time and <= 1.5x the memory.
2. ``gather_in_order`` of 1797 x 10 logits over 3 gloo ranks against one uneven
   gather (``gather_all_tensors``) of the same shards: the target is "one uneven
   gather plus O(N) local work".
"""

from __future__ import annotations

import argparse
import multiprocessing
import resource
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler

import ddpkit


def _make(variant: str, items: int) -> Any:
    data = range(items)
    if variant == "DistributedSampler(shuffle=True)":
        return DistributedSampler(data, num_replicas=2, rank=0, shuffle=True)
    if variant == "wrapper(RandomSampler)":
        return ddpkit.DistributedSamplerWrapper(RandomSampler(data), num_replicas=2, rank=0)
    if variant == "wrapper(RandomSampler, shuffle=True)":
        return ddpkit.DistributedSamplerWrapper(RandomSampler(data), num_replicas=2, rank=0, shuffle=True)
    if variant == "wrapper(BatchSampler(RandomSampler, 32))":
        return ddpkit.DistributedSamplerWrapper(BatchSampler(RandomSampler(data), 32, False), num_replicas=2, rank=0)
    raise ValueError(variant)


def _epoch_time(variant: str, items: int, reps: int) -> float:
    sampler = _make(variant, items)
    best = float("inf")
    for epoch in range(reps):
        sampler.set_epoch(epoch)
        started = time.perf_counter()
        for _ in sampler:
            pass
        best = min(best, time.perf_counter() - started)
    return best


def _epoch_memory(variant: str, items: int) -> float:
    """Peak RSS growth in MB while building the sampler and iterating one epoch (fresh process)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sampler = _make(variant, items)
    for _ in sampler:
        pass
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def sampler_rows(items: int, reps: int) -> list[tuple[str, float, float]]:
    variants = ["DistributedSampler(shuffle=True)", "wrapper(RandomSampler)", "wrapper(RandomSampler, shuffle=True)",
                "wrapper(BatchSampler(RandomSampler, 32))"]  # fmt: skip
    context = multiprocessing.get_context("spawn")
    rows = []
    for variant in variants:
        with context.Pool(1) as pool:  # a fresh process each: peak RSS is per process
            memory = pool.apply(_epoch_memory, (variant, items))
            seconds = pool.apply(_epoch_time, (variant, items, reps))
        rows.append((variant, seconds, memory))
    return rows


def _ordered(reps: int) -> tuple[float, float]:
    """Median seconds of gather_in_order and of one uneven gather of the same shard (3 ranks, 1797 x 10)."""
    sampler = ddpkit.DistributedSamplerWrapper(SequentialSampler(range(1797)))
    shard = list(sampler)
    logits = torch.randn(len(shard), 10)
    ordered, gathered = [], []
    for _ in range(reps):
        dist.barrier()
        started = time.perf_counter()
        ddpkit.gather_in_order(logits, sampler)
        ordered.append(time.perf_counter() - started)
        dist.barrier()
        started = time.perf_counter()
        ddpkit.gather_all_tensors(logits)
        gathered.append(time.perf_counter() - started)
    return statistics.median(ordered), statistics.median(gathered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    rows = sampler_rows(args.items, args.reps)
    base_time, base_memory = rows[0][1], rows[0][2]
    print(f"one epoch of a {args.items:,}-item sampler, rank 0 of 2 (best of {args.reps}; memory: peak RSS growth)")
    print(f"{'sampler':42} {'ms':>8} {'x time':>7} {'MB':>7} {'x memory':>9}")
    for name, seconds, memory in rows:
        print(f"{name:42} {seconds * 1e3:8.1f} {seconds / base_time:7.2f} {memory:7.1f} {memory / base_memory:9.2f}")
    wrapped = next(row for row in rows if row[0] == "wrapper(RandomSampler)")
    verdicts = [
        f"{label} {ratio:.2f} (target <= {target}: {'ok' if ratio <= target else 'MISSED'})"
        for label, ratio, target in (
            ("time", wrapped[1] / base_time, 2.0),
            ("memory", wrapped[2] / base_memory, 1.5),
        )
    ]
    print(f"{wrapped[0]} against DistributedSampler: " + "; ".join(verdicts))

    ordered, gathered = ddpkit.launch(_ordered, 50, nprocs=3, backend="gloo")[0]
    print(f"\ngather_in_order of 1797 x 10 logits over 3 gloo ranks: {ordered * 1e3:.2f} ms; one uneven gather "
          f"of the same shards: {gathered * 1e3:.2f} ms; ratio {ordered / gathered:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
