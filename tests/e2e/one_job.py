"""One training job, three entry points, four kinds of data: what every way of starting a job must get right.

Imported by the session pool's workers (tests/ranks/test_one_job.py) and run as a
script by every launcher of the end-to-end rows, so that all of them run the
same code:

    python tests/e2e/one_job.py OUT_DIR FIRST_ENTRY

runs every case (FIRST_ENTRY's first: it is the one that must create the
process group when a launcher started the process without one) and writes
this rank's results to ``OUT_DIR/rank<r>.json`` (the checkout's root on
``PYTHONPATH``).

Entry points: ``fit`` (a ``TrainLoop.fit`` script), ``patch`` (a hand-written
loop over ``patch_dataloader_to_ddp`` loaders) and ``handler`` (aitoolbox's
style: ``DDPHandler.add_distributed_samplers`` with the launcher's rank and
world size, then a hand-written loop). Data: the digits as a map-style
dataset or as a stream of 8 shards, read with 0 or 2 DataLoader workers.
Every sample carries its index, so the test can count what each rank saw.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import ddpkit
import ddpkit.environments
from ddpkit import checkpoint as checkpoint_module
from ddpkit.examples.digits import digits_datasets
from ddpkit.training import _state as training_state
from tests.helpers import settle_dying_threads

ENTRY_POINTS = ("fit", "patch", "handler")
DATA = ("map0", "map2", "stream0", "stream2")
BATCH = 32
SHARDS = 8


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    train, _ = digits_datasets()
    images, labels = train.tensors
    return images, labels


class IndexedDigitsStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """The training digits as a stream of ``(image, label, index)`` in 8 shards of consecutive rows."""

    num_shards = SHARDS

    def iter_shard(self, shard: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        images, labels = _digits()
        size = -(-len(labels) // SHARDS)
        for index in range(shard * size, min(len(labels), (shard + 1) * size)):
            yield images[index], labels[index], torch.tensor(index)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        for shard in range(SHARDS):
            yield from self.iter_shard(shard)


def train_loader(data: str, context: str | None = None) -> DataLoader[Any]:
    """The single-process training loader of ``data`` (one of :data:`DATA`); its workers start by ``context``
    (default: the process's start method)."""
    workers = int(data[-1])
    options: dict[str, Any] = {"num_workers": workers}
    if workers and context is not None:
        options["multiprocessing_context"] = context
    if data.startswith("stream"):
        return DataLoader(IndexedDigitsStream(), batch_size=BATCH, **options)
    images, labels = _digits()
    dataset = TensorDataset(images, labels, torch.arange(len(labels)))
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, **options)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


class IndexedLoop(ddpkit.TrainLoop):
    """A ``TrainLoop`` over ``(image, label, index)`` batches that records the indices it trains on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels, indices = batch
        self.seen += indices.tolist()
        loss: torch.Tensor = self.criterion(model(images), labels)
        return loss

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, _ = batch
        return model(images), labels


def make_loop(data: str, checkpoint_dir: str | None, context: str | None = None) -> IndexedLoop:
    """The ``TrainLoop`` of the ``fit`` entry point (also what ``fit_distributed`` is compared on)."""
    model = _model()
    images, labels = _digits()
    validation = DataLoader(TensorDataset(images[:300], labels[:300], torch.arange(300)), batch_size=64)
    return IndexedLoop(
        model,
        train_loader(data, context),
        validation,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        checkpoint_dir=checkpoint_dir,
        progress=False,
    )


def weights(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _fit(data: str, checkpoint_dir: str, context: str | None) -> tuple[list[int], list[float]]:
    loop = make_loop(data, checkpoint_dir, context)
    loop.fit(1)
    return loop.seen, weights(loop.model)


class _AitoolboxStyleLoop:
    """What aitoolbox's ``DDPHandler`` reads of its train loop."""

    def __init__(self, loader: DataLoader[Any]) -> None:
        self.train_loader: DataLoader[Any] = loader
        self.validation_loader = self.test_loader = None
        self.callbacks_handler = ddpkit.CallbacksHandler(self)


def _hand_written(loader: DataLoader[Any], checkpoint_dir: str) -> tuple[list[int], list[float]]:
    """A plain DDP loop over ``loader``: DDP's all-reduce, SGD; rank 0 prints and saves."""
    model = _model()
    ddp_model = DistributedDataParallel(model) if ddpkit.is_distributed() else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[int] = []
    for images, labels, indices in loader:
        seen += indices.tolist()
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp_model(images), labels).backward()
        optimizer.step()
    _report(len(seen))
    if ddpkit.get_rank() == 0:
        checkpoint_module.save_checkpoint({"model": model.state_dict()}, Path(checkpoint_dir) / "last.pt")
    return seen, weights(model)


@ddpkit.rank_zero_only
def _report(count: int) -> None:
    print(f"trained on {count} samples on rank 0")


def run_case(entry: str, data: str, out_dir: str, context: str | None = None) -> dict[str, Any]:
    """Train one epoch through ``entry`` on ``data`` (DataLoader workers started by ``context``); what this
    rank saw, printed, wrote and ended with."""
    settle_dying_threads()  # before this case forks DataLoader workers
    checkpoint_dir = os.path.join(out_dir, f"ck-{entry}-{data}")
    os.makedirs(checkpoint_dir, exist_ok=True)
    group_before = ddpkit.is_distributed()
    writes = 0
    save = checkpoint_module.save_checkpoint

    def counted(*args: Any, **kwargs: Any) -> bool:
        nonlocal writes
        writes += 1
        return save(*args, **kwargs)

    printed = io.StringIO()
    with (
        contextlib.redirect_stdout(printed),
        mock.patch.object(checkpoint_module, "save_checkpoint", counted),
        mock.patch.object(training_state, "save_checkpoint", counted),  # TrainLoop's checkpoints
    ):
        if entry == "fit":
            seen, final = _fit(data, checkpoint_dir, context)
        elif entry == "patch":
            seen, final = _hand_written(ddpkit.patch_dataloader_to_ddp(train_loader(data, context)), checkpoint_dir)
        else:
            loop = _AitoolboxStyleLoop(train_loader(data, context))
            environment = ddpkit.detect_environment()  # the rank and world size an aitoolbox script has
            world_size, rank = (
                (dist.get_world_size(), dist.get_rank())
                if ddpkit.is_distributed()
                else (environment.world_size(), environment.global_rank())
            )
            ddpkit.DDPHandler(loop).add_distributed_samplers(world_size, rank)
            seen, final = _hand_written(loop.train_loader, checkpoint_dir)
    return {
        "entry": entry,
        "data": data,
        "group_before": group_before,
        "rank": ddpkit.get_rank(),
        "world_size": ddpkit.get_world_size(),
        "seen": seen,
        "printed": printed.getvalue(),
        "writes": writes,
        "weights": final,
    }


#: The data of the cases run in processes that made their group before any entry point (``spawn-tcp``,
#: ``launch``): the group is what they test, and the DataLoader workers that such processes spawn (each
#: importing torch again, every epoch) are tested by the session pool's cases; one case keeps them here.
SPAWNED_DATA = ("map0", "stream0")
SPAWNED_WITH_WORKERS = ("handler", "stream2")


def run_all(out_dir: str, first: str, spawned: bool = False) -> list[dict[str, Any]]:
    """Every case, ``first``'s entry point first (``spawned``: every entry point on :data:`SPAWNED_DATA`, and
    :data:`SPAWNED_WITH_WORKERS`)."""
    order = [first, *(entry for entry in ENTRY_POINTS if entry != first)]
    if spawned:
        cases = [(entry, data) for entry in order for data in SPAWNED_DATA] + [SPAWNED_WITH_WORKERS]
        return [run_case(entry, data, out_dir) for entry, data in cases]
    return [run_case(entry, data, out_dir) for entry in order for data in DATA]


def run_and_write(out_dir: str, first: str, spawned: bool = False) -> None:
    """:func:`run_all`, this rank's results written to ``out_dir/rank<r>.json``."""
    results = run_all(out_dir, first, spawned)
    Path(out_dir, f"rank{ddpkit.get_rank()}.json").write_text(json.dumps(results))


def _spawned(rank: int, world_size: int, init_method: str, out_dir: str) -> None:
    """PyTorch's DDP tutorial's way: ``init_process_group`` with an explicit rank and world size."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=init_method)
    try:
        run_and_write(out_dir, "fit", spawned=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    """``OUT_DIR FIRST_ENTRY`` under a launcher; ``OUT_DIR spawn-tcp`` or ``OUT_DIR launch`` starts 2 processes.

    SIGUSR1 prints every thread's stack to stderr, in this process and in every process forked from it (the
    DataLoader workers): the test sends it to a job that did not end in time."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    out_dir, way = sys.argv[1], sys.argv[2]
    if way == "spawn-tcp":
        port = ddpkit.environments.find_free_port()
        torch.multiprocessing.spawn(_spawned, args=(2, f"tcp://127.0.0.1:{port}", out_dir), nprocs=2)
    elif way == "launch":
        ddpkit.launch(run_and_write, out_dir, "fit", True, nprocs=2)
    else:
        run_and_write(out_dir, way)


if __name__ == "__main__":
    main()
