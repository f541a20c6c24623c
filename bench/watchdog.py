"""What the hang watchdog costs: DDP training steps and small collectives with it on and off, in the same run.

    python bench/watchdog.py [--blocks 30] [--steps 30] [--reps 200] [--rounds 6] [--device cpu|cuda]

The watchdog has two parts. Its thread (a check every tenth of the deadline)
is started and stopped in alternating blocks of one launch of 2 gloo ranks, so
each block's time is paired with its neighbour's (the median of the paired
ratios is the verdict). Workloads: DDP steps of the 512-1024-10 MLP of
``bench/ddp_step.py`` (batch 256 per rank), a raw scalar ``all_reduce``,
``ddpkit.sync_ddp`` (scalar mean) and ``ddpkit.gather_all_tensors`` (3 x 256
float32). The deadline is 300 s (the default: a check every 5 s). With
``--device cuda`` the ranks are NCCL ranks, one per GPU (up to 2; one GPU gives
a one-rank group), and every workload runs on CUDA tensors, synchronised
before its time is read.

Torch's flight recorder, which the thread reads, is turned on for good when a
process creates its process group, and launch-to-launch noise here is larger
than its cost. So its cost is measured where nothing else costs: a scalar
``all_reduce`` on a one-rank group (NCCL on ``cuda:0`` with ``--device cuda``),
in ``--rounds`` alternating processes with and without it; the difference (microseconds per collective) is then set
against the times above. Targets (from the hangs issue): training at
most 1% slower, small collectives at most 5%.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from ddp_step import batches, mlp, raw_loop
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.batches import move_data_to_device
from ddpkit.hangs import _watchdog
from ddpkit.process_group import collective_device, rank_device

TARGETS = {"DDP training step": 1.01, "raw all_reduce": 1.05, "sync_ddp mean": 1.05, "gather_all_tensors": 1.05}


def _workloads(steps: int, reps: int, device_type: str) -> dict[str, Callable[[], float]]:
    """Each workload as a function returning its time (seconds per step, or the median per call)."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    data = move_data_to_device(batches(steps), device)
    model = DistributedDataParallel(mlp().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scalar = torch.tensor(float(dist.get_rank()), device=device)
    rows = torch.randn(3, 256).to(device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def training() -> float:
        started = time.perf_counter()
        raw_loop(model, optimizer, data)
        synchronize()
        return (time.perf_counter() - started) / steps

    def median_of(fn: Callable[[], Any]) -> Callable[[], float]:
        def timed() -> float:
            times = []
            for _ in range(reps):
                begun = time.perf_counter()
                fn()
                synchronize()
                times.append(time.perf_counter() - begun)
            return statistics.median(times)

        return timed

    return {
        "DDP training step": training,
        "raw all_reduce": median_of(lambda: dist.all_reduce(scalar)),
        "sync_ddp mean": median_of(lambda: ddpkit.sync_ddp(scalar, reduce_op="mean")),
        "gather_all_tensors": median_of(lambda: ddpkit.gather_all_tensors(rows)),
    }


def _slowest(times: dict[str, float]) -> dict[str, float]:
    """The slowest rank's times: the collectives' cost."""
    values = torch.tensor(list(times.values()), dtype=torch.float64, device=collective_device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return dict(zip(times, values.tolist(), strict=True))


def thread_cost(blocks: int, steps: int, reps: int, device_type: str) -> dict[str, list[tuple[float, float]]]:
    """Per block pair, (time with the thread, time without), every workload; the flight recorder on in both."""
    workloads = _workloads(steps, reps, device_type)
    for run in workloads.values():  # warm up
        run()
    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in workloads}
    for block in range(blocks):
        measured: dict[str, dict[str, float]] = {}
        for watching in (True, False) if block % 2 == 0 else (False, True):
            if watching:
                _watchdog.start_watchdog(300.0)
            else:
                _watchdog.stop_watchdog()
            dist.barrier()
            measured["on" if watching else "off"] = _slowest({name: run() for name, run in workloads.items()})
        for name in workloads:
            pairs[name].append((measured["on"][name], measured["off"][name]))
    return pairs


_ONE_RANK = """
import os, statistics, sys, time
if sys.argv[1] == "on":
    os.environ["TORCH_FR_BUFFER_SIZE"] = "256"
import torch, torch.distributed as dist
cuda = sys.argv[3] == "cuda"
if cuda:
    torch.cuda.set_device(0)
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=0,
                        world_size=1)
value = torch.tensor(1.0, device="cuda:0" if cuda else "cpu")
for _ in range(2000):
    dist.all_reduce(value)
medians = []
for _ in range(10):
    times = []
    for _ in range(2000):
        begun = time.perf_counter()
        dist.all_reduce(value)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begun)
    medians.append(statistics.median(times))
print(statistics.median(medians), flush=True)
dist.destroy_process_group()
"""


def recorder_seconds_per_collective(rounds: int, device_type: str) -> tuple[float, float]:
    """Median seconds of a one-rank scalar all_reduce with and without the flight recorder."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    for round_ in range(rounds):
        for mode in ("on", "off") if round_ % 2 == 0 else ("off", "on"):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            command = [sys.executable, "-c", _ONE_RANK, mode, str(port), device_type]
            done = subprocess.run(command, capture_output=True, text=True)
            if not done.stdout.strip():  # its number is printed before the teardown, which may abort
                raise RuntimeError(f"the one-rank probe ({mode}) exited {done.returncode}: {done.stderr[-2000:]}")
            times[mode].append(float(done.stdout.split()[-1]))
    return statistics.median(times["on"]), statistics.median(times["off"])


def _row(name: str, pairs: list[tuple[float, float]], target: float | None) -> str:
    ratios = sorted(on / off for on, off in pairs)
    low, _, high = statistics.quantiles(ratios, n=4)
    on, off = (statistics.median(values) for values in zip(*pairs, strict=True))
    unit, scale = ("ms", 1e3) if name.startswith("DDP") else ("us", 1e6)
    ratio = statistics.median(ratios)
    goal = "" if target is None else f"<= {target:g} {'ok' if ratio <= target else 'MISSED'}"
    return (
        f"{name:22} {on * scale:8.1f} {unit} {off * scale:8.1f} {unit} {ratio:7.3f} {f'({low:.3f}-{high:.3f})':>15} "
        f"{goal}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    backend, nprocs = ("nccl", min(2, torch.cuda.device_count())) if args.device == "cuda" else ("gloo", 2)
    threads = ddpkit.launch(thread_cost, args.blocks, args.steps, args.reps, args.device, nprocs=nprocs,
                            backend=backend, timeout=300)[0]  # fmt: skip
    with_recorder, without = recorder_seconds_per_collective(args.rounds, args.device)
    added = with_recorder - without
    print(f"{nprocs} {backend} ranks ({args.device}); ratio: with / without (median of paired ratios, quartiles)")
    print(f"{'':22} {'with':>11} {'without':>11} {'ratio':>7} {'(quartiles)':>15} target")
    print(f"the watchdog's thread ({args.blocks} alternating blocks in one launch, the flight recorder on in both):")
    for name, target in TARGETS.items():
        print(_row(name, threads[name], target))
    print(
        f"torch's flight recorder: a one-rank scalar all_reduce takes {with_recorder * 1e6:.1f} us with it and "
        f"{without * 1e6:.1f} us without ({args.rounds} alternating processes each): {added * 1e6:+.1f} us per "
        "collective, which is, of the times above:"
    )
    for name, target in TARGETS.items():
        base = statistics.median(off for _, off in threads[name])
        ratio = 1 + max(added, 0.0) / base
        print(f"{name:22} {ratio:7.3f} {'':>29} <= {target:g} {'ok' if ratio <= target else 'MISSED'}")


if __name__ == "__main__":
    main()
