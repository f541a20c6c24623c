"""Benchmark streamed data on 2 gloo ranks: the cost of splitting a stream, and the ends of uneven streams.

    python bench/streams.py [--reps 5] [--epochs 3]

1. One epoch of the streamed digits (``DigitsStream``: a generator parsing the
   CSV's rows, 8 shards of row ranges), batches of 32, on each of 2 ranks:
   every rank reading the raw stream (each sample twice in the job) against a
   ``StreamDataLoader`` split by shard and split by example (each sample once,
   plus one small all-reduce per 8 batches for ``ends="even"``). Reported as distinct
   samples per second of the job (the slower rank's time), best of ``--reps``.
2. ``TrainLoop`` on a stream the ranks share unevenly (3 shards split by shard:
   rank 0 reads two, rank 1 one): seconds per epoch with ``ends="join"`` (rank 1
   steps along on zero-weight batches) against ``ends="even"`` (rank 1 trains
   on repeats of its first batches).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.examples.digits import DigitsStream


def _loader(variant: str) -> DataLoader[Any]:
    if variant == "raw stream on every rank":
        return DataLoader(DigitsStream(), batch_size=32)
    split = "shard" if variant == "split by shard" else "example"
    return ddpkit.StreamDataLoader(ddpkit.ShardedStream(DigitsStream(), split=split), batch_size=32)


def _read(variant: str, reps: int) -> tuple[float, int]:
    """Best seconds (the slower rank's) for an epoch, and the distinct samples the job read."""
    best, seen = float("inf"), 0
    for _ in range(reps):
        loader = _loader(variant)
        dist.barrier()
        started = time.perf_counter()
        count = sum(len(labels) for _, labels in loader)
        seconds = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        best = min(best, float(seconds))
        total = torch.tensor([count])
        dist.all_reduce(total)
        seen = count if variant == "raw stream on every rank" else int(total)
    return best, seen


def _train(ends: str, epochs: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    stream = ddpkit.ShardedStream(DigitsStream(num_shards=3), split="shard")
    loop = ddpkit.TrainLoop(
        model, ddpkit.StreamDataLoader(stream, batch_size=32, ends=ends),  # type: ignore[arg-type]
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), progress=False,
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # rank 0's epoch lines
        loop.fit(1)  # warm-up
        dist.barrier()
        started = time.perf_counter()
        loop.fit(1 + epochs)
    return (time.perf_counter() - started) / epochs


def _measure(reps: int, epochs: int) -> dict[str, Any]:
    variants = ("raw stream on every rank", "split by shard", "split by example")
    reading = {variant: _read(variant, reps) for variant in variants}
    training = {ends: min(_train(ends, epochs) for _ in range(2)) for ends in ("even", "join")}
    return {"reading": reading, "training": training}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    result = ddpkit.launch(_measure, args.reps, args.epochs, nprocs=2, backend="gloo")[0]

    reading = result["reading"]
    base_seconds, base_seen = reading["raw stream on every rank"]
    base_rate = base_seen / base_seconds
    print(f"one epoch of the streamed digits on 2 ranks, batches of 32 (best of {args.reps})")
    print(f"{'loader':28} {'ms':>8} {'samples':>8} {'samples/s':>10} {'x raw':>6}")
    for variant, (seconds, seen) in reading.items():
        rate = seen / seconds
        print(f"{variant:28} {seconds * 1e3:8.1f} {seen:8d} {rate:10.0f} {rate / base_rate:6.2f}")
    even, join = result["training"]["even"], result["training"]["join"]
    print(
        f"\nTrainLoop on a stream split 2:1 between 2 ranks: ends='join' {join * 1e3:.0f} ms per epoch, "
        f"ends='even' {even * 1e3:.0f} ms: ratio {join / even:.2f}"
    )


if __name__ == "__main__":
    main()
