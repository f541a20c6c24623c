"""ddpkit's fixed costs in microseconds: a DDP step through ``DDPPlugin`` and a ``TrainLoop`` step against a
hand-written loop, and each public collective against the raw torch call of the same bytes, with tiny inputs.

    python bench/microseconds.py [--nprocs 1,2] [--rounds 21] [--calls 200] [--collective-rounds 61]
                                 [--collective-calls 40] [--device cpu|cuda] [--only NAME]

1 and then 2 gloo ranks on loopback (``--nprocs``; ``--device cuda``: NCCL, one rank per GPU). Each step workload
runs ``--calls`` steps of ours and of the raw twin in alternating rounds (the order flips each round; a barrier
before each run), so the machine's noise hits both alike; each collective runs ``--collective-calls`` calls a
round, in more and shorter rounds, so that the two runs of a pair lie closer in time (with 21 rounds of 200
calls, the 2-rank gather's ratio varied from 1.15 to 1.45 between runs of the same code on a 2-core machine). A
round's time per call is the slowest rank's. Printed
per workload: the medians over the rounds of the time per call, ``+us`` (ours minus raw) and the median of the
paired ratios. The targets are those of ddpkit's fixed-cost goals: on one rank the ``DDPPlugin`` step at most
1.01x raw DDP and the scalar mean at most 1.10x a raw ``all_reduce``; on two ranks a ``TrainLoop`` step at most
1.05x the hand-written loop, the scalar mean at most 1.10x, ``mp_sync`` of a tensor and the small uneven gather at
most 1.3x (``MISSED`` when a median is above its target).

The model is a 32-32-4 MLP with batches of 8 (a step of well under a millisecond on a CPU, so that per-step
costs show): what a short step pays (small models, RL, a fast GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit.process_group import collective_device, rank_device

Workload = tuple[str, Callable[[], Any], Callable[[], Any], float | None, int]  # name, ours, raw, target, calls

#: The targets (ours / raw, medians) by world size and workload.
TARGETS = {
    1: {"DDPPlugin step": 1.01, "sync_ddp scalar mean": 1.10},
    2: {
        "TrainLoop step (one epoch)": 1.05,
        "sync_ddp scalar mean": 1.10,
        "gather_all_tensors uneven (1|3, 8)": 1.3,
        "mp_sync (4, 8)": 1.3,
    },
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _data(count: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randn(8, 32, generator=generator).to(device), torch.randint(0, 4, (8,), generator=generator)
             .to(device)) for _ in range(count)]  # fmt: skip


def _raw_steps(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any]) -> None:
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def _plugin_steps(plugin: ddpkit.DDPPlugin, model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any]
                  ) -> None:  # fmt: skip
    for x, y in data:
        optimizer.zero_grad()
        (inputs,) = plugin.on_before_forward(model, x)
        nn.functional.cross_entropy(model(inputs), y).backward()
        optimizer.step()


def _hand_written_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any]) -> None:
    """What a TrainLoop epoch does, written by hand: the loader's batches, DDP's step, the loss summed on the
    device (read once, at the epoch's end, as a careful hand-written loop does)."""
    total = torch.zeros(2, dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total[0].add_(loss.detach().double(), alpha=len(y))
        total[1].add_(len(y))
    dist.all_reduce(total)
    total.tolist()


def _step_workloads(device: torch.device, calls: int) -> list[Workload]:
    ids = [device.index] if device.type == "cuda" else None
    data = _data(calls, device)
    raw_model = DistributedDataParallel(_mlp().to(device), device_ids=ids)
    raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    plugin = ddpkit.DDPPlugin()
    plugin_model = plugin.configure_ddp(_mlp().to(device), ids)
    plugin_optimizer = torch.optim.SGD(plugin_model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(8 * calls * dist.get_world_size(), 32, generator=generator),
                            torch.randint(0, 4, (8 * calls * dist.get_world_size(),), generator=generator))  # fmt: skip
    loop_model = _mlp()
    loop = ddpkit.TrainLoop(loop_model, DataLoader(dataset, batch_size=8), optimizer=torch.optim.SGD(
        loop_model.parameters(), lr=0.01), device=device, progress=False, seed=0)  # fmt: skip
    epochs = [0]

    def train_loop_epoch() -> None:
        epochs[0] += 1
        with contextlib.redirect_stdout(io.StringIO()):  # the epoch's line: one write per epoch
            loop.fit(epochs[0])

    hand_model = DistributedDataParallel(_mlp().to(device), device_ids=ids)
    hand_optimizer = torch.optim.SGD(hand_model.parameters(), lr=0.01)
    hand_loader = DataLoader(dataset, batch_size=8, sampler=torch.utils.data.DistributedSampler(dataset, shuffle=False))
    moved = [(x.to(device), y.to(device)) for x, y in hand_loader] if device.type == "cuda" else hand_loader
    return [
        ("DDPPlugin step", lambda: _plugin_steps(plugin, plugin_model, plugin_optimizer, data),
         lambda: _raw_steps(raw_model, raw_optimizer, data), None, calls),
        ("TrainLoop step (one epoch)", train_loop_epoch,
         lambda: _hand_written_epoch(hand_model, hand_optimizer, moved), None, calls),  # type: ignore[arg-type]
    ]  # fmt: skip


def _collective_workloads(device: torch.device) -> list[Workload]:
    rank, world = dist.get_rank(), dist.get_world_size()
    scalar = torch.tensor(float(rank), device=device)
    even = torch.randn(4, 8, device=device)
    uneven = torch.randn(1 if rank == 0 else 3, 8, device=device)
    padded = torch.randn(3, 8, device=device)
    outputs = {"predictions": torch.randn(4, 8, device=device), "labels": torch.arange(4, device=device)}
    dict_bytes = torch.cat([outputs["predictions"].reshape(-1).view(torch.uint8),
                            outputs["labels"].view(torch.uint8)])  # fmt: skip

    def raw_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(out, tensor)
        return out

    def raw_mean() -> torch.Tensor:  # in place, as sync_ddp reduces
        dist.all_reduce(scalar)
        return scalar.div_(world)

    def raw_stack() -> torch.Tensor:
        out = torch.empty(world * even.shape[0], *even.shape[1:], dtype=even.dtype, device=device)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, even)  # torch 2.13 renamed it
        return out.view(world, *even.shape)

    return [
        ("sync_ddp scalar mean", lambda: ddpkit.sync_ddp(scalar, reduce_op="mean"), raw_mean, None, 0),
        ("gather_all_tensors even (4, 8)", lambda: ddpkit.gather_all_tensors(even), lambda: raw_gather(even), None, 0),
        ("gather_all_tensors uneven (1|3, 8)", lambda: ddpkit.gather_all_tensors(uneven), lambda: raw_gather(padded),
         None, 0),
        ("all_gather_ddp_if_available (4, 8)", lambda: ddpkit.all_gather_ddp_if_available(even), raw_stack, None, 0),
        ("mp_sync (4, 8)", lambda: ddpkit.mp_sync(even), lambda: torch.cat(raw_gather(even)), None, 0),
        ("sync_dicts_ddp {predictions, labels}", lambda: ddpkit.sync_dicts_ddp(outputs, world, device),
         lambda: raw_gather(dict_bytes), None, 0),
    ]  # fmt: skip


def _timed(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` calls of ``fn`` (``calls`` 0: ``fn`` does its own ``calls``), the slowest
    rank's."""
    device = rank_device()
    ddpkit.barrier()
    started = time.perf_counter()
    for _ in range(calls or 1):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], device=collective_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def measure(rounds: int, calls: int, collective_rounds: int, collective_calls: int, device_type: str, only: str = ""
            ) -> list[tuple[str, float, float, float, float | None]]:  # fmt: skip
    """Per workload (those whose name contains ``only``): median seconds per call of ours and raw, the median
    paired ratio, the target."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    targets = TARGETS.get(dist.get_world_size(), {})
    rows = []
    for name, ours, raw, _, own_calls in [*_step_workloads(device, calls), *_collective_workloads(device)]:
        if only not in name:
            continue
        per_run = own_calls or collective_calls  # calls inside one run of the workload
        repeat = 0 if own_calls else collective_calls
        for fn in (ours, raw):  # warm up
            _timed(fn, repeat)
        times: dict[str, list[float]] = {"ours": [], "raw": []}
        for number in range(rounds if own_calls else collective_rounds):
            for which in ("ours", "raw") if number % 2 == 0 else ("raw", "ours"):
                times[which].append(_timed(ours if which == "ours" else raw, repeat) / per_run)
        ratios = [o / r for o, r in zip(times["ours"], times["raw"], strict=True)]
        rows.append((name, statistics.median(times["ours"]), statistics.median(times["raw"]),
                     statistics.median(ratios), targets.get(name)))  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="1,2", help="world sizes to measure, comma-separated (default 1,2)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=200, help="steps a round (default 200)")
    parser.add_argument("--collective-rounds", type=int, default=61)
    parser.add_argument("--collective-calls", type=int, default=40, help="collective calls a round (default 40)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--only", default="", help="measure the workloads whose name contains this (default: all)")
    args = parser.parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    for number, nprocs in enumerate(int(n) for n in args.nprocs.split(",")):
        if args.device == "cuda":
            nprocs = min(nprocs, torch.cuda.device_count())
        rows = ddpkit.launch(measure, args.rounds, args.calls, args.collective_rounds, args.collective_calls,
                             args.device, args.only, nprocs=nprocs, backend=backend)[0]  # fmt: skip
        print(f"{chr(10) if number else ''}{nprocs} {backend} rank(s); alternating rounds: steps {args.rounds} x "
              f"{args.calls}, collectives {args.collective_rounds} x {args.collective_calls}; torch "
              f"{torch.__version__}")  # fmt: skip
        print(f"{'workload':40} {'ddpkit us':>10} {'raw us':>9} {'+us':>8} {'ratio':>6} {'target':>8}")
        for name, ours, raw, ratio, target in rows:
            goal = "" if target is None else f"<= {target:g}"
            verdict = "" if target is None else ("ok" if ratio <= target else "MISSED")
            print(f"{name:40} {ours * 1e6:10.1f} {raw * 1e6:9.1f} {(ours - raw) * 1e6:+8.1f} {ratio:6.3f} "
                  f"{goal:>8} {verdict}".rstrip())  # fmt: skip


if __name__ == "__main__":
    main()
