"""Steps per second of DDP driven through ``DDPPlugin`` against a hand-written DDP loop, same run.

    python bench/ddp_step.py [--blocks 10] [--steps 20] [--device cpu|cuda]

A 512-1024-10 MLP, batch 256 per rank, 2 gloo ranks (``--device cuda``: NCCL,
one rank per GPU, up to 2), SGD. The two loops train
twin models on the same data in alternating blocks of ``--steps`` steps, so the
machine's noise hits both alike; the ratio is plugin / raw steps per second
(target >= 0.98; on CUDA >= 0.99). Then, for each named comm hook, the bytes it all-reduces in one
step of this model (counted by wrapping ``torch.distributed.all_reduce`` during
the step), next to the plain all-reduce.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd
from torch.nn.parallel import DistributedDataParallel

import ddpkit
from ddpkit.batches import move_data_to_device
from ddpkit.comm_hooks import batched_powersgd_works, bf16_supported
from ddpkit.process_group import collective_device, rank_device

#: The lowest acceptable ratio plugin / raw steps per second, per device.
TARGETS = {"cpu": 0.98, "cuda": 0.99}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 10))


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randn(256, 512, generator=generator), torch.randint(0, 10, (256,), generator=generator))
            for _ in range(count)]  # fmt: skip


def raw_loop(model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any]) -> None:
    for x, y in data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def plugin_loop(plugin: ddpkit.DDPPlugin, model: nn.Module, optimizer: torch.optim.Optimizer, data: list[Any]) -> None:
    for x, y in data:
        optimizer.zero_grad()
        inputs = plugin.on_before_forward(model, x)
        nn.functional.cross_entropy(model(*inputs), y).backward()
        optimizer.step()


def _device(device_type: str) -> torch.device:
    return rank_device() if device_type == "cuda" else torch.device("cpu")


def _ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    return DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def measure(blocks: int, steps: int, device_type: str = "cpu") -> dict[str, Any]:
    device = _device(device_type)
    data = move_data_to_device(batches(steps), device)
    raw_model = _ddp(mlp(), device)
    raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    plugin = ddpkit.DDPPlugin()
    plugin_model = plugin.configure_ddp(mlp().to(device), [device.index] if device.type == "cuda" else None)
    plugin_optimizer = torch.optim.SGD(plugin_model.parameters(), lr=0.01)
    runs: dict[str, Callable[[], None]] = {
        "raw": lambda: raw_loop(raw_model, raw_optimizer, data),
        "plugin": lambda: plugin_loop(plugin, plugin_model, plugin_optimizer, data),
    }
    for run in runs.values():  # warm up
        run()
    rates: dict[str, list[float]] = {"raw": [], "plugin": []}
    for block in range(blocks):
        for name in ["raw", "plugin"] if block % 2 == 0 else ["plugin", "raw"]:
            ddpkit.barrier()
            started = time.perf_counter()
            runs[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - started], device=collective_device())
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rates[name].append(steps / float(elapsed))
    return {"rates": rates, "bytes": hook_bytes(data, device)}


def hook_bytes(data: list[Any], device: torch.device) -> dict[str, int | str]:
    """Bytes all-reduced by each hook in one step, after its start iterations."""
    counts: dict[str, int | str] = {}
    hooks: list[tuple[str, Any, Any]] = [
        ("allreduce (plain)", None, "allreduce"),
        ("fp16", None, "fp16"),
        ("bf16", None, "bf16"),
        ("powersgd, rank 1", power_sgd.PowerSGDState(None, 1, start_powerSGD_iter=2), "powersgd"),
        ("powersgd, rank 4", power_sgd.PowerSGDState(None, 4, start_powerSGD_iter=2), "powersgd"),
        ("batched_powersgd, rank 1", power_sgd.PowerSGDState(None, 1, start_powerSGD_iter=2), "batched_powersgd"),
        ("post_localsgd (local phase)", post_local_sgd.PostLocalSGDState(None, None, start_localSGD_iter=2),
         "post_localsgd"),
    ]  # fmt: skip
    for label, state, name in hooks:
        if (name == "bf16" and not bf16_supported()) or (name == "batched_powersgd" and not batched_powersgd_works()):
            counts[label] = "cannot run here"
            continue
        model = _ddp(mlp(), device)
        ddpkit.register_ddp_comm_hook(model, state, name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        raw_loop(model, optimizer, data[:3])  # past the start iterations
        counts[label] = _count_one_step(model, optimizer, data[3])
    return counts


def _count_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any) -> int:
    sent = 0
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal sent
        sent += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        raw_loop(model, optimizer, [batch])
    finally:
        dist.all_reduce = original
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    backend, nprocs = ("nccl", min(2, torch.cuda.device_count())) if args.device == "cuda" else ("gloo", 2)
    result = ddpkit.launch(measure, args.blocks, args.steps, args.device, nprocs=nprocs, backend=backend)[0]
    raw, plugin = (statistics.median(result["rates"][k]) for k in ("raw", "plugin"))
    ratios = [p / r for p, r in zip(result["rates"]["plugin"], result["rates"]["raw"], strict=True)]
    target = TARGETS[args.device]
    print(
        f"512-1024-10 MLP, batch 256 per rank, {nprocs} {backend} ranks, {args.blocks} alternating blocks of "
        f"{args.steps} steps"
    )
    print(f"raw DistributedDataParallel loop: {raw:7.2f} steps/s")
    print(f"through DDPPlugin:                {plugin:7.2f} steps/s")
    ratio = statistics.median(ratios)
    verdict = "ok" if ratio >= target else "MISSED"
    print(f"ratio (median of paired blocks):  {ratio:7.3f}  (target >= {target}: {verdict})")
    print("\nbytes all-reduced per step, per rank")
    plain = result["bytes"]["allreduce (plain)"]
    for label, sent in result["bytes"].items():
        share = f"{sent / plain:6.3f} x plain" if isinstance(sent, int) else ""
        print(f"  {label:30} {sent if isinstance(sent, str) else f'{sent:>12,}'}  {share}")


if __name__ == "__main__":
    main()
