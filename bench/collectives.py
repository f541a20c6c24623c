"""Benchmark ddpkit's collectives against raw torch.distributed, measured in the same run.

    python bench/collectives.py [--nprocs 2] [--reps 30] [--device cpu|cuda]

Runs on gloo over loopback with N CPU processes, or with ``--device cuda`` on
NCCL with one process per GPU (tensors on the GPU; ``tools/gpu-check.sh``). Each repetition times ours and
the raw baseline back to back (each after a barrier, the order alternating),
and the verdict is the median of those paired ratios: this machine is noisy
(tight loops of the same collective vary 3x from run to run), so only ratios
measured side by side mean anything. Targets are from the collectives issue.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.process_group import collective_device, rank_device

Workload = tuple[str, Callable[[], Any], Callable[[], Any], float]


def _raw_all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


#: Targets (ratio ours / raw) per device: uneven large and small gathers, dict sync, scalar mean.
TARGETS = {"cpu": (0.5, 1.5, 1.25, 1.15), "cuda": (0.5, 1.3, 1.25, 1.1)}


def workloads(device: torch.device) -> list[Workload]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    big_rows = 50000 if rank == 0 else 37000
    big = torch.randn(big_rows, 256, device=device)
    big_padded = torch.randn(50000, 256, device=device)
    few = torch.randn(1 if rank == 0 else 3, 256, device=device)
    few_padded = torch.randn(3, 256, device=device)
    n = 20000
    results = {
        "emb": torch.randn(n, 128, device=device),
        "labels": torch.randint(0, 1000, (n,), device=device),
        "paths": [f"images/class_{i % 1000:04d}/{rank}_{i:06d}.jpg" for i in range(n)],
        "scores": np.random.default_rng(rank).random(n),
    }
    raw_bytes = torch.cat(
        [results["emb"].view(torch.uint8).reshape(-1), results["labels"].view(torch.uint8),
         torch.from_numpy(results["scores"]).view(torch.uint8).to(device)]
    )  # fmt: skip
    scalar = torch.tensor(float(rank), device=device)
    large, small, sync, mean = TARGETS[device.type]

    def raw_mean() -> torch.Tensor:  # in place, as sync_ddp (and Lightning's) reduces
        dist.all_reduce(scalar)
        return scalar.div_(dist.get_world_size())

    world = dist.get_world_size()
    return [
        ("uneven gather (50000|37000, 256) f32", lambda: ddpkit.gather_all_tensors(big),
         lambda: _raw_all_gather(big_padded), large),
        ("uneven gather (1|3, 256) f32", lambda: ddpkit.gather_all_tensors(few),
         lambda: _raw_all_gather(few_padded), small),
        ("dict sync emb+labels+20k paths+scores", lambda: ddpkit.sync_dicts_ddp(results, world),
         lambda: _raw_all_gather(raw_bytes), sync),
        ("  (all_gather_object of the same dict)", lambda: _gather_object(results),
         lambda: _raw_all_gather(raw_bytes), float("nan")),
        ("scalar mean, in place", lambda: ddpkit.sync_ddp(scalar, reduce_op="mean"), raw_mean, mean),
    ]  # fmt: skip


def _gather_object(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _time(fn: Callable[[], Any]) -> float:
    device = rank_device()
    ddpkit.barrier()
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the collective's kernels are done, not only queued
    elapsed = torch.tensor([time.perf_counter() - started], device=collective_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
    return float(elapsed)


def measure(reps: int, device_type: str = "cpu") -> list[tuple[str, float, float, float, float, float]]:
    """Per workload: median ours, median raw, median of the paired ratios, its quartiles, the target."""
    rows = []
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    for name, ours, raw, target in workloads(device):
        for _ in range(3):  # warm up both
            ours()
            raw()
        ours_times, raw_times = [], []
        for rep in range(reps):  # pairs, alternating which goes first
            if rep % 2:
                raw_times.append(_time(raw))
                ours_times.append(_time(ours))
            else:
                ours_times.append(_time(ours))
                raw_times.append(_time(raw))
        ratios = sorted(o / r for o, r in zip(ours_times, raw_times, strict=True))
        quartiles = statistics.quantiles(ratios, n=4)
        rows.append((name, statistics.median(ours_times), statistics.median(raw_times),
                     statistics.median(ratios), quartiles[0], quartiles[2], target))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        args.nprocs = min(args.nprocs, torch.cuda.device_count())  # NCCL: one rank per GPU
    rows = ddpkit.launch(measure, args.reps, args.device, nprocs=args.nprocs, backend=backend)[0]
    where = "on loopback" if backend == "gloo" else f"on {torch.cuda.get_device_name(0)}"
    print(f"{args.nprocs} {backend} ranks {where}, {args.reps} paired repetitions (each after a barrier)")
    print(f"{'workload':42} {'ddpkit ms':>10} {'raw ms':>9} {'ratio':>6} {'(quartiles)':>13} {'target':>8}")
    for name, ours, raw, ratio, low, high, target in rows:
        goal = "" if target != target else f"<= {target:g}"
        verdict = "" if not goal else ("ok" if ratio <= target else "MISSED")
        print(
            f"{name:42} {ours * 1e3:10.3f} {raw * 1e3:9.3f} {ratio:6.2f} {f'({low:.2f}-{high:.2f})':>13} "
            f"{goal:>8} {verdict}"
        )


if __name__ == "__main__":
    main()
