"""A replica group of the chaos suite's job (``tests/support/chaos.py``):
``ddpkit run --fault-tolerance -n N --max-restarts K -m tests.e2e.chaos_job OUT EPOCHS DELAY [CHECKPOINT_DIR]``.

Each rank trains the digits classifier (``tests/support/chaos.py``'s :func:`chaos_loop`) and writes, in ``OUT``:

- ``<group>.rank<r>.pid``: ``{"pid", "restart", "t"}`` when it starts (the harness signals that process);
- ``<group>.rank<r>.jsonl``: a JSON line per committed step (``t``, ``pid``, ``epoch``, ``step`` counted from 0,
  the dataset indices this rank trained on in the committed attempt, and the quorum's member processes), and
  one per start and end;
- at the end, its weights (``<group>.rank<r>.pt``) and history (``<group>.rank<r>.json``).

``DELAY`` seconds of sleep after each committed step stretch the run so that the faults land in it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddpkit import Callback
from tests.support.chaos import ChaosLoop, chaos_loop, process_name


class CommitLog(Callback):
    """After each committed step, one JSON line: what this rank trained on in it and the quorum that committed it."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def on_batch_end(self, train_loop: Any) -> None:
        loop: ChaosLoop = train_loop
        done = loop.global_step - 1  # the step just committed, counted from 0
        committed = (done, loop.state.failed_steps, loop.state.dealt_again)
        items = [i for attempt, chunk in loop.pending if attempt == committed for i in chunk]
        loop.pending.clear()
        driver = loop._run._driver  # the quorum's member processes (NAME:uuid): which quorum committed the step
        members = sorted(getattr(driver, "_processes", ()))
        loop.write({"t": time.time(), "pid": os.getpid(), "epoch": loop.epoch, "step": done, "items": items,
                    "members": members})  # fmt: skip
        time.sleep(self.delay)


def main(out: str, epochs: int, delay: float, checkpoint_dir: str | None) -> None:
    name = process_name()
    base = Path(out) / name
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    Path(f"{base}.pid.tmp").write_text(json.dumps({"pid": os.getpid(), "restart": restart, "t": time.time()}))
    os.replace(f"{base}.pid.tmp", f"{base}.pid")
    loop = chaos_loop(fault_tolerant=True)
    loop.log_path = f"{base}.jsonl"
    loop.write({"start": time.time(), "pid": os.getpid(), "restart": restart})
    if checkpoint_dir is not None:
        loop.checkpoint_dir, loop.checkpoint_every = Path(checkpoint_dir), 5
    history = loop.fit(epochs, callbacks=[CommitLog(delay)])
    weights = loop.full_state_dict()  # every rank; a sharded model's: its group's rank 0 gets them
    if weights:
        torch.save(weights, f"{base}.pt")
    Path(f"{base}.json").write_text(json.dumps(history))
    loop.write({"end": time.time(), "pid": os.getpid()})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), (sys.argv[4:] or [None])[0])
