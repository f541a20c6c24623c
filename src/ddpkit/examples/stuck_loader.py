"""The digits demo with one rank's DataLoader worker stuck: what ddpkit reports when a job hangs.

    python -m ddpkit.examples.stuck_loader [--timeout 10]

Trains the demo's classifier with ``TrainLoop`` on 2 CPU processes, with one
DataLoader worker per rank. On rank 1 the worker blocks for good in its fifth
batch (a stand-in for a deadlocked read), so rank 0 waits in DDP's gradient
all-reduce for a rank that never comes. After ``--timeout`` seconds the
watchdog stops the job and ``launch`` raises :class:`~ddpkit.HangError`; this
prints it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

from ddpkit.errors import HangError
from ddpkit.examples.demo import build_model
from ddpkit.examples.digits import digits_datasets
from ddpkit.jobs.launch import launch
from ddpkit.training import TrainLoop

__all__ = ["StuckOnRankOne", "main"]


class StuckOnRankOne(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits training split; in rank 1's DataLoader worker the 129th read never returns."""

    def __init__(self) -> None:
        self.images, self.labels = digits_datasets(seed=0)[0].tensors
        self.reads = 0  # each worker process counts its own

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        if os.environ.get("RANK") == "1" and self.reads == 129:
            time.sleep(3600)  # the stuck read
        return self.images[index], self.labels[index]


def train() -> None:
    """One epoch of the demo's training, as each rank runs it."""
    model = build_model()
    loader = DataLoader(StuckOnRankOne(), batch_size=32, shuffle=True, num_workers=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    TrainLoop(model, loader, optimizer=optimizer, progress=False).fit(1)


def main(argv: list[str] | None = None) -> None:
    """Run the stuck job and print the hang report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="the hang deadline in seconds (default 10)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        launch(train, nprocs=2, timeout=args.timeout)
    except HangError as error:
        print(error)
        print(f"\n(the job ended {time.monotonic() - started:.1f} s after it started)")
        return
    raise SystemExit("the job did not hang")


if __name__ == "__main__":
    main()
