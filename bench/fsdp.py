"""Sharded training (``FSDPPlugin``): its step against a hand-written ``fully_shard`` loop and against DDP, the bytes
each rank holds, and sharded checkpoints against ``last.pt``, same run.

    python bench/fsdp.py [--blocks 6] [--steps 20] [--device cpu|cuda]

1. A transformer-like stack (8 residual MLP blocks of width 256 over sequences of 16), batch 16 per rank, Adam, 2
   gloo ranks (``--device cuda``: NCCL on the GPUs there are, up to 2). A ``TrainLoop`` with
   ``FSDPPlugin`` trains one epoch of ``--steps`` steps, then the hand-written loop (the same model
   ``fully_shard``-ed block by block, a ``DataLoader`` over a ``DistributedSampler``) the same steps, in
   alternating blocks; then the same ``TrainLoop`` with ``DDPPlugin`` against it with ``FSDPPlugin``. Ratios are
   of steps per second (target: TrainLoop FSDP >= 0.98x the hand-written loop).
2. The bytes of parameters, gradients and Adam's state one rank holds after a step, on 1, 2 and 4 ranks
   (1 rank: what DDP holds on every rank).
3. Activation checkpointing (``FSDPPlugin(activation_checkpointing_policy={Block})``) against none, the same
   stack over sequences of 128 (activations that matter), 2 ranks, alternating epochs: steps per second, and the
   memory a step adds to what the rank held before it (``torch.cuda.max_memory_allocated`` on a GPU; on the CPU
   the peak resident set size, reset through ``/proc/self/clear_refs``); epochs of a quarter of ``--steps``.
4. What the step during which a checkpoint is written costs, against the other steps, with ``checkpoint_async``
   and without: the ~100 MB model below, SGD, a ``TrainLoop`` with ``DDPPlugin`` on 2 ranks, 41 steps
   checkpointing every 5, twice each (rank 0's step times, medians of 16 saving steps; target: async <= 1.25x a
   step).
5. A checkpoint of a ~100 MB model (6 linear layers of 2048 x 2048, 24 M parameters) and its Adam state:
   written and read sharded (``torch.distributed.checkpoint``, every rank its shards) against DDP's ``last.pt``
   (rank 0 writes the whole state with ``torch.save``; every rank reads it), 2 ranks, alternating, 3 rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit import Callback
from ddpkit.checkpoint import load_checkpoint, save_checkpoint
from ddpkit.process_group import collective_device, rank_device

TARGET = 0.98
WIDTH, DEPTH, LENGTH, BATCH = 256, 8, 16, 16


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(32, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def _data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    items = steps * BATCH * dist.get_world_size()
    return TensorDataset(torch.randn(items, LENGTH, 32, generator=generator), torch.randint(0, 10, (items,)))


def _quiet(fit: Any, *args: Any, **kwargs: Any) -> Any:
    """``fit(...)`` (or ``configure_ddp``) without its lines (this benchmark prints its own)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fit(*args, **kwargs)


def _seconds(device: torch.device, run: Any) -> float:
    """The slowest rank's seconds for ``run()``."""
    ddpkit.barrier()
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = torch.tensor([time.perf_counter() - started], device=collective_device())
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _loop(plugin: ddpkit.DDPPlugin, data: TensorDataset, device: torch.device) -> ddpkit.TrainLoop:
    model = Stack()
    return ddpkit.TrainLoop(
        model, DataLoader(data, batch_size=BATCH, shuffle=True), optimizer=torch.optim.Adam(model.parameters()),
        plugin=plugin, device=device, progress=False,
    )  # fmt: skip


class HandWritten:
    """The loop one writes with torch alone: ``fully_shard`` each block and the model, Adam on the shards."""

    def __init__(self, data: TensorDataset, device: torch.device) -> None:
        from torch.distributed.fsdp import fully_shard

        self.model = Stack().to(device)
        for block in self.model.blocks:
            fully_shard(block)
        fully_shard(self.model)
        self.optimizer = torch.optim.Adam(self.model.parameters())
        self.sampler = DistributedSampler(data, seed=0)
        self.loader = DataLoader(data, batch_size=BATCH, sampler=self.sampler)
        self.device, self.epoch = device, 0

    def run(self) -> None:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        for x, y in self.loader:
            x, y = x.to(self.device), y.to(self.device)
            self.optimizer.zero_grad()
            nn.functional.cross_entropy(self.model(x), y).backward()
            self.optimizer.step()


def steps(blocks: int, count: int, device_type: str) -> dict[str, Any]:
    """Steps per second of each loop, per block (alternating order)."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    data = _data(count)
    sharded, ddp = _loop(ddpkit.FSDPPlugin(), data, device), _loop(ddpkit.DDPPlugin(), data, device)
    raw = HandWritten(data, device)
    runs = {"raw": raw.run, "fsdp": lambda: _quiet(sharded.fit, sharded.epoch + 1),
            "ddp": lambda: _quiet(ddp.fit, ddp.epoch + 1)}  # fmt: skip
    for run in runs.values():  # warm up
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for block in range(blocks):
        for name in list(runs) if block % 2 == 0 else list(runs)[::-1]:
            rates[name].append(count / _seconds(device, runs[name]))
    return rates


def _resident_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _added_memory(device: torch.device, run: Any) -> int:
    """The bytes ``run()`` held at its peak beyond what this process held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(device) - before)
    before = _resident_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from now
    run()
    return _resident_bytes("VmHWM") - before


def recompute(blocks: int, count: int, device_type: str) -> dict[str, list[float]]:
    """Steps per second and the memory a step adds (bytes), with and without activation checkpointing."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    count = max(2, count // 4)  # steps of 8x the activations: a quarter as many
    items = count * BATCH * dist.get_world_size()
    data = TensorDataset(torch.randn(items, 128, 32, generator=generator), torch.randint(0, 10, (items,)))
    loops = {"none": _loop(ddpkit.FSDPPlugin(), data, device),
             "blocks": _loop(ddpkit.FSDPPlugin(activation_checkpointing_policy={Block}), data, device)}  # fmt: skip
    results: dict[str, list[float]] = {f"{name} {what}": [] for name in loops for what in ("rate", "memory")}
    for loop in loops.values():  # warm up
        _quiet(loop.fit, loop.epoch + 1)

    def epoch(loop: ddpkit.TrainLoop) -> Any:
        return lambda: _quiet(loop.fit, loop.epoch + 1)

    for block in range(blocks):
        for name in list(loops) if block % 2 == 0 else list(loops)[::-1]:
            results[f"{name} rate"].append(count / _seconds(device, epoch(loops[name])))
            added = torch.tensor([float(_added_memory(device, epoch(loops[name])))], device=collective_device())
            dist.all_reduce(added, op=dist.ReduceOp.MAX)  # the rank that added most
            results[f"{name} memory"].append(float(added))
    return results


class _StepTimes(Callback):
    """The seconds from each step's end to the next's."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.ends.append(time.perf_counter())


def stalls(steps: int, device_type: str) -> dict[str, list[float]]:
    """Seconds of each step that follows a checkpoint and of the others, with and without checkpoint_async."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    shared = [tempfile.mkdtemp(prefix="ddpkit-bench-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(shared, src=0)  # one directory that every rank sees, as fit checks
    directory = Path(shared[0])
    items = steps * 4 * dist.get_world_size()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(items, 2048, generator=generator), torch.randint(0, 10, (items,)))
    results: dict[str, list[float]] = {}
    for asynchronous in (False, True, False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(6)))
        times = _StepTimes()
        where = directory / f"{asynchronous}-{len(results)}"
        loop = ddpkit.TrainLoop(
            model, DataLoader(data, batch_size=4), optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
            device=device, progress=False, checkpoint_dir=where, checkpoint_every=5, checkpoint_async=asynchronous,
        )  # fmt: skip
        _quiet(loop.fit, 1, callbacks=[times])
        durations = [b - a for a, b in zip(times.ends, times.ends[1:], strict=False)]  # steps 2, 3, ...
        kind = "async" if asynchronous else "sync"
        after = [d for number, d in enumerate(durations, start=2) if number % 5 == 1]  # 6, 11, ...: a save's step
        results.setdefault(f"{kind} saving", []).extend(after)
        results.setdefault(f"{kind} other", []).extend(
            d for number, d in enumerate(durations, start=2) if number % 5 not in (0, 1)
        )  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return results


def held(device_type: str) -> dict[str, int]:
    """This rank's bytes of the stack sharded by FSDPPlugin: parameters and gradients after a backward, Adam's
    state after its step."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    model, plugin = Stack().to(device), ddpkit.FSDPPlugin()
    optimizer = torch.optim.Adam(model.parameters())
    if dist.get_world_size() > 1:
        _quiet(plugin.configure_ddp, model, [device.index or 0] if device.type == "cuda" else None)
        plugin.shard_optimizer(optimizer)
    x = torch.randn(BATCH, LENGTH, 32, device=device)
    nn.functional.cross_entropy(model(x), torch.zeros(BATCH, dtype=torch.int64, device=device)).backward()
    holds = plugin.memory(model)
    optimizer.step()
    holds["optimizer"] = plugin.memory(model, optimizer)["optimizer"]
    holds["total"] = holds["parameters"] + holds["gradients"] + holds["optimizer"]
    return holds


def checkpoints(rounds: int, device_type: str) -> dict[str, list[float]]:
    """Seconds to write and read the big model's checkpoint, sharded and whole."""
    device = rank_device() if device_type == "cuda" else torch.device("cpu")
    directory = Path(tempfile.mkdtemp(prefix="ddpkit-bench-")) if dist.get_rank() == 0 else None
    shared = [str(directory)]
    dist.broadcast_object_list(shared, src=0)
    where = Path(shared[0])

    def big() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(6))).to(device)
        return model, torch.optim.Adam(model.parameters())

    fsdp_plugin, ddp_plugin = ddpkit.FSDPPlugin(), ddpkit.DDPPlugin()
    sharded_model, sharded_optimizer = big()
    _quiet(fsdp_plugin.configure_ddp, sharded_model, [device.index or 0] if device.type == "cuda" else None)
    fsdp_plugin.shard_optimizer(sharded_optimizer)
    whole_model, whole_optimizer = big()
    for model, optimizer in ((sharded_model, sharded_optimizer), (whole_model, whole_optimizer)):
        model(torch.randn(4, 2048, device=device)).sum().backward()
        optimizer.step()  # Adam's state exists
    times: dict[str, list[float]] = {"sharded write": [], "sharded read": [], "whole write": [], "whole read": []}

    def write_sharded() -> None:
        fsdp_plugin.checkpoint_state(sharded_model, sharded_optimizer, where, "bench.dcp")

    def read_sharded() -> None:
        fsdp_plugin.load_checkpoint_state(sharded_model, sharded_optimizer, {}, {}, where / "bench.dcp")

    def write_whole() -> None:
        weights, optimizer_state, _ = ddp_plugin.checkpoint_state(whole_model, whole_optimizer, where, "")
        if dist.get_rank() == 0:
            save_checkpoint({"model": weights, "optimizer": optimizer_state}, where / "last.pt")

    def read_whole() -> None:
        state = load_checkpoint(where / "last.pt", map_location=device)
        ddp_plugin.load_checkpoint_state(whole_model, whole_optimizer, state["model"], state["optimizer"], None)

    for index in range(rounds):
        order = [("sharded", write_sharded, read_sharded), ("whole", write_whole, read_whole)]
        for kind, write, read in order if index % 2 == 0 else order[::-1]:
            times[f"{kind} write"].append(_seconds(device, write))
            times[f"{kind} read"].append(_seconds(device, read))
    ddpkit.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    backend, nprocs = ("nccl", min(2, torch.cuda.device_count())) if args.device == "cuda" else ("gloo", 2)
    rates = ddpkit.launch(steps, args.blocks, args.steps, args.device, nprocs=nprocs, backend=backend)[0]
    print(
        f"{DEPTH} residual MLP blocks of width {WIDTH} over sequences of {LENGTH}, batch {BATCH} per rank, Adam, "
        f"{nprocs} {backend} ranks, {args.blocks} alternating blocks of {args.steps} steps"
    )
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"hand-written fully_shard loop:     {median['raw']:7.2f} steps/s")
    print(f"TrainLoop with FSDPPlugin:         {median['fsdp']:7.2f} steps/s")
    print(f"TrainLoop with DDPPlugin:          {median['ddp']:7.2f} steps/s")
    ratio = statistics.median(f / r for f, r in zip(rates["fsdp"], rates["raw"], strict=True))
    verdict = "ok" if ratio >= TARGET else "MISSED"
    print(f"TrainLoop FSDP / hand-written:     {ratio:7.3f}  (target >= {TARGET}: {verdict})")
    price = statistics.median(f / d for f, d in zip(rates["fsdp"], rates["ddp"], strict=True))
    print(f"TrainLoop FSDP / TrainLoop DDP:    {price:7.3f}  (the price of sharding this small model)")

    print("\nbytes one rank holds after a step (parameters, gradients, Adam's state)")
    whole: dict[str, int] | None = None
    for world in (1, 2, 4):
        holds = ddpkit.launch(held, args.device, nprocs=world, backend="gloo" if args.device == "cpu" else backend)[0]
        whole = whole or holds
        share = holds["total"] / whole["total"]
        label = "1 rank (DDP: every rank)" if world == 1 else f"{world} ranks, FSDP"
        print(
            f"  {label:26} params {holds['parameters']:>10,}  grads {holds['gradients']:>10,}  "
            f"adam {holds['optimizer']:>10,}  total {holds['total']:>11,}  {share:5.3f} x DDP's"
        )

    checked = ddpkit.launch(recompute, args.blocks, args.steps, args.device, nprocs=nprocs, backend=backend)[0]
    print(f"\nactivation checkpointing of the blocks, sequences of 128, {nprocs} ranks, {args.blocks} alternating "
          "epochs")  # fmt: skip
    middle = {name: statistics.median(values) for name, values in checked.items()}
    print(f"  none:   {middle['none rate']:6.2f} steps/s   a step adds {middle['none memory'] / 2**20:7.1f} MiB")
    print(f"  blocks: {middle['blocks rate']:6.2f} steps/s   a step adds {middle['blocks memory'] / 2**20:7.1f} MiB")
    print(f"  time x{middle['none rate'] / middle['blocks rate']:.2f}, memory x"
          f"{middle['blocks memory'] / max(1.0, middle['none memory']):.2f} (blocks / none)")  # fmt: skip

    stalled = ddpkit.launch(stalls, 41, args.device, nprocs=nprocs, backend=backend)[0]
    print(f"\nthe step during which a checkpoint of 6 x Linear(2048, 2048) is written, SGD, DDP on {nprocs} ranks")
    for kind in ("sync", "async"):
        saving, other = statistics.median(stalled[f"{kind} saving"]), statistics.median(stalled[f"{kind} other"])
        target = "  (target <= 1.25x: " + ("ok)" if saving / other <= 1.25 else "MISSED)") if kind == "async" else ""
        print(
            f"  {kind:5}  {saving * 1000:7.1f} ms against {other * 1000:6.1f} ms a step: {saving / other:5.2f}x{target}"
        )

    times = ddpkit.launch(checkpoints, 3, args.device, nprocs=nprocs, backend=backend)[0]
    print(f"\ncheckpoint of 6 x Linear(2048, 2048) (24 M parameters, 100 MB) and Adam state, {nprocs} ranks, 3 rounds")
    for kind in ("write", "read"):
        sharded, whole_s = statistics.median(times[f"sharded {kind}"]), statistics.median(times[f"whole {kind}"])
        print(f"  {kind:5}  sharded (DCP) {sharded:6.2f} s   last.pt {whole_s:6.2f} s   ratio {sharded / whole_s:5.2f}")


if __name__ == "__main__":
    main()
