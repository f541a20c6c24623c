"""What TrainLoop's training recipes cost against hand-written torch code doing the same, in the same run.

    python bench/recipes.py [--blocks 8] [--steps 30]

The 512-1024-10 MLP of ``bench/ddp_step.py``, batch 256 per rank, 2 gloo
ranks, SGD with momentum, data from a ``DataLoader`` over an in-memory set.
For each option (none, a per-step cosine schedule, bf16 autocast, fp16 with a
``GradScaler``, gradient-norm clipping, all of them) ``TrainLoop`` trains one
epoch of ``--steps`` steps per block, alternating with a hand-written DDP loop
that does the same (``torch.autocast``, ``GradScaler``, ``clip_grad_norm_``,
``scheduler.step()``) on a twin model. The verdict is the median of the paired
ratios TrainLoop / hand-written seconds per epoch (target <= 1.02). bf16 and
fp16 against float32 on CPU are reported as measured (CPU autocast may be
slower; nothing is tuned for it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

TARGET = 1.02
OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "cosine per step": {"lr_scheduler_interval": "step", "schedule": True},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "16-mixed": {"precision": "16-mixed"},
    "clip norm 1.0": {"gradient_clip_norm": 1.0},
    "all": {"lr_scheduler_interval": "step", "schedule": True, "precision": "bf16-mixed", "gradient_clip_norm": 1.0},
}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _data(steps: int, world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    rows = 256 * steps * world_size
    return TensorDataset(
        torch.randn(rows, 512, generator=generator), torch.randint(0, 10, (rows,), generator=generator)
    )


def _cosine(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)


def _train_loop(data: TensorDataset, option: dict[str, Any], total: int) -> ddpkit.TrainLoop:
    model = _mlp()
    kwargs = {k: v for k, v in option.items() if k != "schedule"}
    if option.get("schedule"):
        kwargs["lr_scheduler"] = functools.partial(_cosine, total=total)
    return ddpkit.TrainLoop(
        model, DataLoader(data, batch_size=256), optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        progress=False, **kwargs,
    )  # fmt: skip


class _HandWritten:
    """The same training written with torch alone."""

    def __init__(self, data: TensorDataset, option: dict[str, Any], total: int) -> None:
        self.model = DistributedDataParallel(_mlp())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.sampler: DistributedSampler[Any] = DistributedSampler(data, shuffle=False)
        self.loader = DataLoader(data, batch_size=256, sampler=self.sampler)
        self.scheduler = _cosine(self.optimizer, total) if option.get("schedule") else None
        precision = option.get("precision", "32")
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
        self.scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
        self.clip = option.get("gradient_clip_norm")
        self.epoch = 0

    def epoch_of_steps(self) -> None:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for x, y in self.loader:
            with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype is not None):
                loss = nn.functional.cross_entropy(self.model(x), y)
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()  # type: ignore[no-untyped-call]
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()


def _timed(run: Any) -> float:
    dist.barrier()
    started = time.perf_counter()
    run()
    elapsed = torch.tensor([time.perf_counter() - started])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def measure(blocks: int, steps: int) -> dict[str, dict[str, float]]:
    """Per option: the median paired ratio TrainLoop / hand-written, and each one's median seconds per epoch."""
    data = _data(steps, dist.get_world_size())
    total = (blocks + 1) * steps
    results: dict[str, dict[str, float]] = {}
    for name, option in OPTIONS.items():
        loop, hand = _train_loop(data, option, total), _HandWritten(data, option, total)
        loop.fit(1)  # warm up both (and set the loop up)
        hand.epoch_of_steps()
        times: dict[str, list[float]] = {"ddpkit": [], "torch": []}
        for block in range(blocks):
            order = ["ddpkit", "torch"] if block % 2 == 0 else ["torch", "ddpkit"]
            for who in order:
                run = functools.partial(loop.fit, loop.epoch + 1) if who == "ddpkit" else hand.epoch_of_steps
                times[who].append(_timed(run))
        ratios = [a / b for a, b in zip(times["ddpkit"], times["torch"], strict=True)]
        results[name] = {
            "ratio": statistics.median(ratios),
            "ddpkit_ms": 1000 * statistics.median(times["ddpkit"]) / steps,
            "torch_ms": 1000 * statistics.median(times["torch"]) / steps,
        }
    return results


def _quiet_measure(blocks: int, steps: int) -> dict[str, dict[str, float]]:
    with contextlib.redirect_stdout(io.StringIO()):  # TrainLoop's epoch lines
        return measure(blocks, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results = ddpkit.launch(_quiet_measure, args.blocks, args.steps, nprocs=2)[0]
    print(f"TrainLoop recipes vs hand-written torch, 2 gloo ranks, {args.steps} steps per epoch, {args.blocks} blocks")
    print(f"{'option':<16} {'ddpkit ms/step':>15} {'torch ms/step':>14} {'ratio':>7}  target <= {TARGET}")
    for name, row in results.items():
        verdict = "ok" if row["ratio"] <= TARGET else "MISSED"
        print(f"{name:<16} {row['ddpkit_ms']:>15.2f} {row['torch_ms']:>14.2f} {row['ratio']:>7.3f}  {verdict}")
    base = results["none"]["torch_ms"]
    for precision in ("bf16-mixed", "16-mixed"):
        print(f"{precision} against float32 on CPU (hand-written): {results[precision]['torch_ms'] / base:.2f}x")


if __name__ == "__main__":
    main()
