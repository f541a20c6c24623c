"""``python -m ddpkit.examples.elastic``: digits training that survives nodes leaving and joining.

Run it once per node with torchrun's elastic syntax, as its own launcher::

    python -m ddpkit.examples.elastic --nnodes 1:2 --rdzv-endpoint HOST:29400 --checkpoint-dir DIR

or under ``ddpkit run --nnodes 1:2 ... -m ddpkit.examples.elastic --checkpoint-dir DIR``
(then each worker trains as one rank). The job goes on while one node is up and
takes in a second one when it joins; each change restarts the workers, which
resume from the last checkpoint (every ``--checkpoint-every`` steps) on the new
world size. The global batch (``--global-batch-size``, 64) stays the same, so
the steps are those of an unresized run and the result is the same up to
rounding. ``--record DIR`` writes, for every optimizer step, which training
samples each rank used (one JSON line per rank and step), to count that every
sample is used once per epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ddpkit.callbacks import Callback, TrainLoopView
from ddpkit.collectives import all_gather_object
from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import BalancedBatchSampler
from ddpkit.fsdp_plugin import FSDPPlugin
from ddpkit.process_group import get_rank, get_world_size, seed_everything
from ddpkit.training import TrainLoop

__all__ = [
    "IndexedDataset",
    "RecordSteps",
    "RecordingTrainLoop",
    "elastic_train_loop",
    "main",
    "parse_args",
    "recorded_steps",
    "samples_per_epoch",
]


class IndexedDataset(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """``(image, label, index)``: a dataset that says which sample each item is."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        image, label = self.data[index]
        return image, label, index


class RecordingTrainLoop(TrainLoop):
    """A :class:`~ddpkit.TrainLoop` on ``(image, label, index)`` batches that can record the samples of each step.

    Args:
        *args: positional arguments, as ``**kwargs``.
        **kwargs: as for ``TrainLoop``.
        record: a directory for ``samples-<pid>.jsonl`` (one line per optimizer
            step: epoch, step, world size, rank, the attempt's port, a time stamp
            in seconds, and the sample indices this rank used), or ``None``.
        step_delay: seconds to sleep in each training step (to watch a resize).
    """

    def __init__(self, *args: Any, record: str | Path | None = None, step_delay: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record = Path(record) if record is not None else None
        self.step_delay = step_delay
        self.used: list[int] = []

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels, indices = batch
        self.used += indices.tolist()
        if self.step_delay:
            time.sleep(self.step_delay)
        loss: torch.Tensor = self.criterion(model(images), labels)
        return loss

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels, _ = batch
        return model(images), labels


class RecordSteps(Callback):
    """After every step, append this rank's samples of the step to the loop's record; at the end rank 0 saves
    the weights (to ``out``, when given).

    Each line names its attempt (a run of ``fit``: an id and a start time in
    seconds, rank 0's), so that :func:`recorded_steps` can tell which attempt
    did a step last.
    """

    def __init__(self, out: str | Path | None = None) -> None:
        self.out = out
        self.attempt: tuple[str, float] = ("", 0.0)

    def on_train_begin(self, train_loop: TrainLoopView) -> None:
        self.attempt = all_gather_object((uuid.uuid4().hex, time.time()))[0]  # rank 0's, on every rank

    def on_train_end(self, train_loop: TrainLoopView) -> None:
        if self.out is None:
            return
        assert isinstance(train_loop, RecordingTrainLoop), "RecordSteps records a RecordingTrainLoop's samples"
        weights = train_loop.full_state_dict()  # every rank: a sharded model's are gathered to rank 0
        if get_rank() == 0:
            torch.save(weights, self.out)

    def on_batch_end(self, train_loop: TrainLoopView) -> None:
        assert isinstance(train_loop, RecordingTrainLoop), "RecordSteps records a RecordingTrainLoop's samples"
        if train_loop.record is None:
            return
        line = {
            "epoch": train_loop.epoch,
            "step": train_loop.global_step,
            "world_size": get_world_size(),
            "rank": get_rank(),
            "attempt": self.attempt[0],
            "started": self.attempt[1],
            "time": time.time(),
            "samples": train_loop.used,
        }
        train_loop.record.mkdir(parents=True, exist_ok=True)
        with open(train_loop.record / f"samples-{os.getpid()}.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")
        train_loop.used = []


def elastic_train_loop(args: argparse.Namespace) -> RecordingTrainLoop:
    """The training, written as single-process code: digits, an MLP (no dropout), SGD, a global batch."""
    train_set, val_set = digits_datasets(seed=args.seed)
    seed_everything(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    train = IndexedDataset(train_set)
    if args.sampler == "pk":  # P classes x K samples per batch: a batch sampler, sharded whole batches at a time
        sampler = BalancedBatchSampler(train_set.tensors[1], args.batch_size // 4, 4)
        train_loader: DataLoader[Any] = DataLoader(train, batch_sampler=sampler)
    else:
        train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    return RecordingTrainLoop(
        model,
        train_loader,
        DataLoader(IndexedDataset(val_set), batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        progress=False,
        global_batch_size=args.global_batch_size,
        plugin=FSDPPlugin() if args.sharded else None,
        record=args.record,
        step_delay=args.step_delay,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of :func:`main` (``--help`` lists it)."""
    parser = argparse.ArgumentParser(prog="python -m ddpkit.examples.elastic", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, help="shared by the nodes (they resume from it)")
    parser.add_argument("--nnodes", default="1:2", help="MIN:MAX nodes (default 1:2)")
    parser.add_argument("--rdzv-endpoint", default="127.0.0.1:29400", metavar="HOST:PORT")
    parser.add_argument("--nprocs", type=int, default=1, help="processes per node (default 1)")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after a node is lost (default 3)")
    parser.add_argument("--rdzv-conf", default="", metavar="KEY=VALUE,...", help="torch's rendezvous settings")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank and batch (a multiple of 4 for pk)")
    parser.add_argument("--sampler", choices=("items", "pk"), default="items")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default=None, metavar="DIR", help="record each step's samples here")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--out", type=Path, default=None, help="write the trained weights here (torch.save)")
    parser.add_argument("--sharded", action="store_true", help="shard the model over the ranks (FSDPPlugin)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Train (see the module docstring); rank 0 writes ``--out`` (the weights) at the end."""
    args = parse_args(argv)
    loop = elastic_train_loop(args)
    history = loop.fit_distributed(
        args.epochs, args.nprocs, callbacks=[RecordSteps(args.out)], max_restarts=args.max_restarts,
        nnodes=args.nnodes, rdzv_endpoint=args.rdzv_endpoint, rdzv_conf=args.rdzv_conf, backend="gloo",
    )  # fmt: skip
    print(json.dumps({"train_loss": history["train_loss"], "accuracy": history["validation_accuracy"][-1]}))


def recorded_steps(directory: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The records (``--record``) of every optimizer step that counts, by step.

    A step done twice (by an attempt that was stopped before its next
    checkpoint, then by the attempt that resumed from the checkpoint) counts
    once: as the attempt that started last did it. Each value holds one record
    per rank of that attempt.
    """
    paths = Path(directory).glob("samples-*.jsonl")
    lines = [json.loads(text) for path in paths for text in path.read_text().splitlines()]
    steps: dict[int, list[dict[str, Any]]] = {}
    for line in sorted(lines, key=lambda line: line["started"]):
        kept = steps.setdefault(line["step"], [])
        if kept and kept[0]["attempt"] != line["attempt"]:
            kept.clear()  # a later attempt did this step again
        kept.append(line)
    return steps


def samples_per_epoch(directory: str | Path) -> dict[int, list[int]]:
    """The training samples each epoch used (sorted), from the records of the steps that count."""
    used: dict[int, list[int]] = {}
    for records in recorded_steps(directory).values():
        for record in records:
            used.setdefault(record["epoch"], []).extend(record["samples"])
    return {epoch: sorted(samples) for epoch, samples in sorted(used.items())}


if __name__ == "__main__":
    main()
