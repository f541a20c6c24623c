"""What each CUDA test runs in its workers (top level: the workers import it).

Every function takes the device it runs on, so that the same code is also run
on CPU with gloo (``python -m tests.gpu.cuda_jobs``) where there is no GPU: a
failure on the GPU machine is then about CUDA or NCCL, not about the test.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit.batches import move_data_to_device
from ddpkit.process_group import collective_device, rank_device


def device_of_rank() -> torch.device:
    """``cuda:<local rank>`` modulo the devices (two ranks may share one GPU under gloo), else CPU."""
    return rank_device()


def collectives() -> dict[str, Any]:
    """Each collective on this rank's device: where the results come back and what they hold."""
    device = device_of_rank()
    rank, world = dist.get_rank(), dist.get_world_size()
    found: dict[str, Any] = {"backend": dist.get_backend(), "collective_device": str(collective_device())}
    if device.type == "cuda":
        found["current_device"] = torch.cuda.current_device()
    uneven = torch.arange(rank + 2, dtype=torch.float32, device=device)
    gathered = ddpkit.gather_all_tensors(uneven)
    found["gather"] = [(str(t.device), t.tolist()) for t in gathered]
    scalar = torch.tensor(float(rank + 1), device=device)
    mean = ddpkit.sync_ddp(scalar, reduce_op="mean")
    found["mean"] = (str(mean.device), float(mean))
    objects = ddpkit.all_gather_object({"rank": rank, "t": torch.full((2,), float(rank), device=device)})
    found["objects"] = [(item["rank"], str(item["t"].device), item["t"].tolist()) for item in objects]
    embeddings = {"emb": torch.full((rank + 1, 3), float(rank), device=device)}
    on_cpu = ddpkit.sync_dicts_ddp(embeddings, world)  # OML's default: device="cpu"
    synced = ddpkit.sync_dicts_ddp(embeddings, world, device)
    found["dict"] = (str(synced["emb"].device), list(synced["emb"].shape))
    found["dict_default"] = str(on_cpu["emb"].device)
    batch = {"x": torch.ones(2), "nested": [torch.zeros(1), "label"]}
    moved = move_data_to_device(batch, device)
    found["moved"] = [str(moved["x"].device), str(moved["nested"][0].device), moved["nested"][1]]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return found


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(device)


def ddp_plugin_step(hook: Any) -> dict[str, Any]:
    """One step of a model wrapped by ``DDPPlugin`` (``device_ids=[local rank]`` on CUDA), with a comm hook."""
    device = device_of_rank()
    plugin = ddpkit.DDPPlugin()
    model = plugin.configure_ddp(_model(device), device_ids=[device.index] if device.type == "cuda" else None)
    if hook is not None:
        ddpkit.register_ddp_comm_hook(model, ddp_comm_hook=hook)
    generator = torch.Generator().manual_seed(dist.get_rank())
    inputs = move_data_to_device(torch.randn(8, 16, generator=generator), device)
    loss = model(inputs).square().mean()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return {"device": str(grads.device), "grads": grads.float().cpu().tolist()}


def train_loop(epochs: int) -> dict[str, Any]:
    """``TrainLoop.fit`` on the digits with its default device (``cuda:<local rank>`` on a GPU)."""
    from torch.utils.data import DataLoader

    from ddpkit.examples.demo import build_model
    from ddpkit.examples.digits import digits_datasets

    train, validation = digits_datasets()[:2]
    torch.manual_seed(0)
    model = build_model()
    loop = ddpkit.TrainLoop(
        model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(validation, batch_size=64),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1), criterion=nn.CrossEntropyLoss(), progress=False,
    )  # fmt: skip
    history = loop.fit(epochs)
    return {"device": str(next(loop.model.parameters()).device), "history": history}


class _StrictBetween(ddpkit.Callback):
    """Makes any synchronising CUDA call raise (``torch.cuda.set_sync_debug_mode("error")``) after step ``first``
    and until step ``last``, and counts the host reads there (tests/support/host_reads.py)."""

    def __init__(self, first: int, last: int) -> None:
        from tests.support.host_reads import CountReadsBetweenSteps

        self.first, self.last = first, last
        self.counter = CountReadsBetweenSteps(first, last)

    def on_batch_end(self, train_loop: Any) -> None:
        step, cuda = train_loop.global_step, train_loop.device.type == "cuda"
        if step == self.last and cuda:
            torch.cuda.set_sync_debug_mode("default")
        self.counter.on_batch_end(train_loop)
        if step == self.first and cuda:
            torch.cuda.set_sync_debug_mode("error")


def train_loop_never_syncs(options: dict[str, Any]) -> dict[str, Any]:
    """Steps 3 to 20 of the digits TrainLoop (SGD, ``options``: clipping, bf16, a schedule) on this rank's device
    with CUDA's sync debug mode at "error": a step that waits for the device raises. The host reads counted there
    and the device."""
    from tests.builders import digits_loop as build

    loop = build(32, device=device_of_rank(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **options)
    strict = _StrictBetween(2, 20)
    try:
        loop.fit(1, callbacks=[strict])
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
    return {"device": str(next(loop.model.parameters()).device), "reads": strict.counter.per_step()}


class DeviceNote(ddpkit.Callback):
    """Writes, at each epoch's end, the device of the model's weights to ``FOLDER/<REPLICA_GROUP_ID>.device``."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_epoch_end(self, train_loop: Any) -> None:
        device = str(next(train_loop.model.parameters()).device)
        with open(os.path.join(self.folder, f"{os.environ.get('REPLICA_GROUP_ID', 'none')}.device"), "w") as file:
            file.write(device)


def digits_loop(fault_tolerance: Any) -> Any:
    """The digits classifier with a global batch of 64 (16 an item's batch), the same weights and order every time:
    in each replica group of a fault-tolerant run, and in the one-process run it is compared with."""
    from torch.utils.data import DataLoader

    from ddpkit.examples.demo import build_model
    from ddpkit.examples.digits import digits_datasets

    train, validation = digits_datasets(seed=0)[:2]
    torch.manual_seed(0)
    model = build_model()
    return ddpkit.TrainLoop(
        model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(validation, batch_size=50),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), global_batch_size=64,
        progress=False, fault_tolerance=fault_tolerance,
    )  # fmt: skip


def fault_tolerant_fit(folder: str, epochs: int) -> dict[str, Any]:
    """``fit_distributed(epochs, num_processes=2)`` with torchft (two replica groups, each on ``cuda:0`` when there
    is a GPU), then the same loop's ``fit`` in this process: the devices each group trained on, both histories
    and the largest difference between the two runs' weights."""
    from ddpkit.fault_tolerance import TorchFT

    tolerant = digits_loop(TorchFT(timeout=30.0, quorum_timeout=60.0))
    history = tolerant.fit_distributed(epochs, num_processes=2, callbacks=[DeviceNote(folder)])
    reference = digits_loop(None)
    expected = reference.fit(epochs)
    found, wanted = tolerant.model.state_dict(), reference.model.state_dict()
    return {
        "devices": {name: (Path(folder) / name).read_text() for name in sorted(os.listdir(folder))},
        "reference_device": str(next(reference.model.parameters()).device),
        "history": history,
        "reference_history": expected,
        "gap": max(float((found[k].cpu().double() - wanted[k].cpu().double()).abs().max()) for k in wanted),
    }


def flight_recorder() -> dict[str, Any]:
    """What ddpkit set for torch's flight recorder and whether NCCL's asynchronous error handling is on."""
    names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    return {name: os.environ.get(name) for name in names}


class Numbers(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """0 .. n-1 as a stream."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(torch.arange(self.n, dtype=torch.float32))


def stream_ends() -> list[int]:
    """37 items split over the ranks: the ranks agree on the end through the group's device (CUDA under NCCL) and
    take as many batches each. Returns every rank's batch count."""
    from ddpkit import ShardedStream, StreamDataLoader

    loader = StreamDataLoader(ShardedStream(Numbers(37)), batch_size=4)
    count = torch.tensor([float(sum(1 for _ in loader))], device=collective_device())
    return [int(c) for c in ddpkit.gather_all_tensors(count)]


def _main() -> None:
    """The same jobs on CPU with gloo, with the checks the CUDA tests make that hold on any device."""
    plain = ddpkit.launch(ddp_plugin_step, None, nprocs=2, backend="gloo")[0]
    halved = ddpkit.launch(ddp_plugin_step, "fp16", nprocs=2, backend="gloo")[0]
    worst = max(abs(a - b) for a, b in zip(plain["grads"], halved["grads"], strict=True))
    print(f"ddp_plugin_step: {len(plain['grads'])} gradients on {plain['device']}; fp16 hook off by {worst:.1e}")
    assert worst < 2e-3, worst
    found = ddpkit.launch(collectives, nprocs=2, backend="gloo")[0]
    print("collectives:", found)
    assert found["gather"] == [("cpu", [0.0, 1.0]), ("cpu", [0.0, 1.0, 2.0])], found
    ends = ddpkit.launch(stream_ends, nprocs=2, backend="gloo")[0]
    print("stream_ends:", ends)
    assert ends == [5, 5], ends
    print("flight_recorder:", ddpkit.launch(flight_recorder, nprocs=2, backend="gloo")[0])
    strict = ddpkit.launch(train_loop_never_syncs, {"gradient_clip_norm": 0.3}, nprocs=2, backend="gloo")[0]
    print("train_loop_never_syncs:", strict)
    assert strict["reads"] == 0.0, strict
    history = ddpkit.launch(train_loop, 1, nprocs=2, backend="gloo")[0]["history"]
    print("train_loop:", history)
    assert history["validation_accuracy"][-1] > 0.5, history
    try:
        import torchft  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        found = fault_tolerant_fit(folder, 1)
    print("fault_tolerant_fit:", {k: v for k, v in found.items() if "history" not in k})
    assert found["devices"] == {"group-0.device": "cpu", "group-1.device": "cpu"}, found
    assert found["gap"] < 1e-5, found


if __name__ == "__main__":  # python -m tests.gpu.cuda_jobs
    _main()
