"""One replica group of a fault-tolerant ``TrainLoop``:
``python -m tests.e2e.ft_trainloop ID LIGHTHOUSE OUT KILL_AT DELAY [CHECKPOINT_DIR]``, or
``ddpkit run --fault-tolerance -n 3 -m tests.e2e.ft_trainloop - - FOLDER KILL_AT DELAY`` (the id and lighthouse
from the environment, ``OUT`` = ``FOLDER/<id>`` (``FOLDER/<id>.rank<r>`` for rank ``r`` > 0 of a group of
several ranks), and only the first start of ``$FT_KILL_GROUP`` (default ``group-2``) kills itself: its rank
``$FT_KILL_RANK`` alone, where given; ``$FT_KILL_ALSO=GROUP:RANK:STEP``: that rank of that group's first start
kills itself too, at that step).

Trains the digits classifier with ``TrainLoop(fault_tolerance=TorchFT(...), global_batch_size=GLOBAL_BATCH)``.
Every committed step appends a JSON line to ``OUT.jsonl``: the epoch, the step, the dataset indices this
group trained on in it, the number of replica groups of its quorum, the process id and the time. With
``KILL_AT`` > 0 the process SIGKILLs itself in the middle of step ``KILL_AT``, or of the first step it
computes after that (after writing ``{"kill": t}``; with ``$FT_KILL_AFTER`` seconds it first waits that long
inside the step, so that the other groups wait for it inside the gradients' all-reduce when it dies); with
``KILL_AT`` < 0 it hangs for 8 s there instead (after writing ``{"hang": t}``).
With ``$FT_REQUEUE=1`` the loop has ``requeue=True`` (SLURM's SIGUSR1: a checkpoint, then ``scontrol requeue``).
With ``$FT_PLUGIN=fsdp`` each group shards the model over its ranks (``FSDPPlugin()``; rank 0 of each group
saves the whole weights, every rank's ``OUT.json`` says which part of each weight it held).
With ``$FT_NUM_WORKERS`` the groups' training loader has that many DataLoader workers (the one-process
reference run none). With ``CHECKPOINT_DIR`` the loop checkpoints there every 7 steps (and resumes from it).
With ``$FT_LATE_RESTART`` (paths, comma-separated), a group started again waits for those files (at most 120 s)
before it trains: a restart that comes after the others finished.
At the end: the weights in ``OUT.pt``, the history in ``OUT.json``. (``... resume OUT CHECKPOINT_DIR EPOCHS``:
:func:`resume`.)

With ``$FT_RESTART_MARKER`` (a path; ``{group}`` in it stands for the group's id), a group started again (under
its agent, or with ``$FT_RESTARTED=1``) creates that file once it has joined (its manager heartbeats, so the
lighthouse waits for it for the next quorum). With ``$FT_WAIT_FOR`` (paths, comma-separated), every group waits
for the first file after committing step ``$FT_WAIT_AT`` (steps, as many), for the second after the second
step, ..., for at most 120 s each. Both at one path: a restarted group, whose Python, torch and torchft take
several seconds to start (more on a loaded machine), is sure to find peers to take the state from, and a
group that joins late is sure to find the others still training. With ``$FT_DELAY_UNTIL`` (a path), ``DELAY`` holds
only until that file exists (a test's phases need a job still stepping; after them the job ends at full speed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import Callback, FSDPPlugin, TrainLoop
from ddpkit._gradients import local_tensor
from ddpkit.examples.demo import build_model
from ddpkit.examples.digits import digits_datasets
from ddpkit.fault_tolerance import TorchFT

GLOBAL_BATCH = 64
BATCH = 16
EPOCHS = 3


class IndexedLoop(TrainLoop):
    """Batches ``(images, labels, indices)``; the indices of each attempt at a step are kept in :attr:`pending`
    (an attempt not committed, or a share computed for a quorum that then changed, is left out of the log)."""

    kill_at = 0
    hung = False
    #: With ``$FT_PERTURB_AT``: this group changes its weights on its own at that step (what a bug would do).
    perturb_at = int(os.environ.get("FT_PERTURB_AT", "0"))
    #: Where the step log goes: ``OUT.jsonl``, or ``OUT/<REPLICA_GROUP_ID>.jsonl`` with :attr:`folder`.
    out = ""
    folder = False
    #: Under agents that start a group again: only this group's first start kills itself.
    kill_group: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[tuple[int, int, int], list[int]]] = []
        self._file: Any = None

    @property
    def log(self) -> Any:
        """The step log, opened (for appending) in the process that trains."""
        if self._file is None:
            path = os.path.join(self.out, os.environ["REPLICA_GROUP_ID"] + _rank_suffix()) if self.folder else self.out
            self._file = open(f"{path}.jsonl", "a")  # noqa: SIM115  # open while the process trains
        return self._file

    def dies(self) -> bool:
        """Whether this process is the one to kill itself (or hang) at step ``kill_at``."""
        if self.kill_group is None:
            return True
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        rank = os.environ.get("FT_KILL_RANK")
        group = os.environ.get("REPLICA_GROUP_ID")
        return group == self.kill_group and first and rank in (None, os.environ.get("RANK", "0"))

    def dies_also(self) -> bool:
        """Whether this process is ``$FT_KILL_ALSO``'s (``GROUP:RANK:STEP``) and has reached its step."""
        also = os.environ.get("FT_KILL_ALSO")
        if not also or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return False
        group, rank, step = also.split(":")
        here = (os.environ.get("REPLICA_GROUP_ID"), os.environ.get("RANK", "0"))
        return here == (group, rank) and self.global_step >= int(step)

    def attempt(self) -> tuple[int, int, int]:
        """Which attempt at which step this is: the step, the steps not committed, the shares dealt again."""
        return self.global_step, self.state.failed_steps, self.state.dealt_again

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels, indices = batch
        if (self.kill_at > 0 and self.global_step >= self.kill_at and self.dies()) or self.dies_also():
            time.sleep(float(os.environ.get("FT_KILL_AFTER", "0")))  # the others reach the all-reduce meanwhile
            self.log.write(json.dumps({"kill": time.time(), "pid": os.getpid()}) + "\n")
            self.log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kill_at < 0 and self.global_step >= -self.kill_at and not self.hung:  # hangs once, 8 s
            self.hung = True
            self.log.write(json.dumps({"hang": time.time(), "pid": os.getpid()}) + "\n")
            self.log.flush()
            time.sleep(8.0)
        if self.perturb_at and self.global_step == self.perturb_at and self.dies():  # a bug's effect, once
            self.perturb_at = 0
            with torch.no_grad():
                next(model.parameters()).add_(0.01)
        self.pending.append((self.attempt(), indices.tolist()))
        return nn.functional.cross_entropy(model(images), labels)


def _rank_suffix() -> str:
    """``.rank<r>`` for rank ``r`` > 0 of a replica group of several ranks (each rank logs what it trained on)."""
    rank = int(os.environ.get("RANK", "0"))
    return f".rank{rank}" if rank else ""


def restarted() -> bool:
    """Whether this process is a group started again (by its agent, or by the test with ``$FT_RESTARTED=1``)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("FT_RESTARTED") == "1"


class StepLog(Callback):
    """After each committed step: the indices of its attempt that was committed, one JSON line (and the wait
    for a restarted group described in the module's docstring); each other callback, a line with its epoch."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.marker = os.environ.get("FT_RESTART_MARKER")
        self.delay_until = os.environ.get("FT_DELAY_UNTIL")
        paths, at = os.environ.get("FT_WAIT_FOR"), os.environ.get("FT_WAIT_AT")
        self.waits = dict(zip(map(int, at.split(",")), paths.split(","), strict=True)) if paths and at else {}

    @staticmethod
    def _event(train_loop: Any, name: str) -> None:
        train_loop.log.write(json.dumps({"event": name, "epoch": train_loop.epoch, "t": time.time()}) + "\n")
        train_loop.log.flush()

    def on_train_begin(self, train_loop: Any) -> None:
        self._event(train_loop, "train_begin")

    def on_epoch_begin(self, train_loop: Any) -> None:
        self._event(train_loop, "epoch_begin")
        if self.marker and restarted():  # joined: the manager heartbeats
            Path(self.marker.replace("{group}", os.environ.get("REPLICA_GROUP_ID", ""))).touch()

    def on_epoch_end(self, train_loop: Any) -> None:
        self._event(train_loop, "epoch_end")

    def on_train_end(self, train_loop: Any) -> None:
        self._event(train_loop, "train_end")

    def on_batch_end(self, train_loop: Any) -> None:
        loop: IndexedLoop = train_loop
        done = loop.global_step - 1  # the step just committed, counted from 0
        committed = (done, loop.state.failed_steps, loop.state.dealt_again)
        items = [i for attempt, chunk in loop.pending if attempt == committed for i in chunk]
        loop.pending.clear()
        record = {"t": time.time(), "epoch": loop.epoch, "step": done, "items": items, "pid": os.getpid(),
                  "groups": loop.step_metrics.get("replica_groups")}  # fmt: skip
        loop.log.write(json.dumps(record) + "\n")
        loop.log.flush()
        if not (self.delay_until and os.path.exists(self.delay_until)):
            time.sleep(self.delay)
        if done in self.waits:
            deadline = time.monotonic() + 120.0
            while not os.path.exists(self.waits[done]) and time.monotonic() < deadline:
                time.sleep(0.1)


def inked(batch: Any) -> torch.Tensor:
    """A batch's "tokens" (``tokens_fn``): its inked pixels."""
    return (batch[0] > 0).sum()


def build_loop(fault_tolerance: TorchFT | None, sharded: bool | None = None) -> IndexedLoop:
    """The same loop in every group and in the one-process reference run (same weights, order, optimizer);
    ``sharded`` (default: with fault tolerance and ``$FT_PLUGIN=fsdp``) with ``FSDPPlugin()``."""
    train_set, val_set = digits_datasets(seed=0)
    images, labels = train_set.tensors
    indexed = TensorDataset(images, labels, torch.arange(len(labels)))
    torch.manual_seed(0)
    model = build_model()
    workers = int(os.environ.get("FT_NUM_WORKERS", "0")) if fault_tolerance is not None else 0
    if sharded is None:
        sharded = os.environ.get("FT_PLUGIN") == "fsdp" and fault_tolerance is not None
    return IndexedLoop(
        model, DataLoader(indexed, batch_size=BATCH, shuffle=True, num_workers=workers),
        DataLoader(val_set, batch_size=50),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), global_batch_size=GLOBAL_BATCH,
        progress=False, fault_tolerance=fault_tolerance, requeue=os.environ.get("FT_REQUEUE") == "1", tokens_fn=inked,
        plugin=FSDPPlugin() if sharded else None,
    )  # fmt: skip


def records(out: Path) -> list[dict[str, Any]]:
    path = Path(f"{out}.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps(outs: list[Path]) -> list[dict[str, Any]]:
    return [r for out in outs for r in records(out) if "step" in r]


def check_callbacks_in_order(out: Path) -> list[tuple[str, int]]:
    """The callbacks a group that ran to its end logged to ``out`` came in order: ``on_train_begin`` first and
    ``on_train_end`` last; every step and ``on_epoch_end`` in the epoch of the last ``on_epoch_begin``, each
    epoch ended once, epochs never going back, the last epoch ended. The events, as ``(name, epoch)``."""
    events = [(r.get("event", "step"), r["epoch"]) for r in records(out) if "event" in r or "step" in r]
    assert events[0][0] == "train_begin", events[:3]
    assert events[-1][0] == "train_end", events[-3:]
    current, ended = -1, []
    for name, epoch in events[1:-1]:
        if name == "epoch_begin":
            assert epoch >= current, f"{out.name}: epoch {epoch} began after epoch {current}"
            current = epoch
        else:
            assert epoch == current, f"{out.name}: {name} in epoch {epoch}, but epoch {current} began last"
            assert name != "epoch_end" or epoch not in ended, f"{out.name}: epoch {epoch} ended twice"
            ended += [epoch] if name == "epoch_end" else []
    assert ended[-1:] == [EPOCHS - 1], f"{out.name}: the epochs ended were {ended}"
    return events


def check_against_one_process(outs: list[Path], finals: list[Path], count: bool = True) -> None:
    """Every training item in exactly one committed step per epoch (counted from what each group trained
    on), and every group's final weights within 1e-5 of one process trained on the same global batches."""
    reference = build_loop(None)
    history = reference.fit(EPOCHS)
    items = len(reference.train_loader.dataset)
    committed = steps(outs)
    for epoch in range(EPOCHS if count else 0):
        counted = Counter(i for r in committed if r["epoch"] == epoch for i in r["items"])
        assert sorted(counted) == list(range(items)), f"epoch {epoch}: {items - len(counted)} items never used"
        assert set(counted.values()) == {1}, f"epoch {epoch}: items used twice: {counted.most_common(3)}"
    expected = reference.model.state_dict()
    finals_weights = {final.name: torch.load(f"{final}.pt") for final in finals}

    def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    between = {f"{a}-{b}": gap(finals_weights[a], finals_weights[b]) for a in finals_weights for b in finals_weights
               if a < b}  # fmt: skip
    for final in finals:
        off = gap(finals_weights[final.name], expected)
        assert off < 1e-5, (
            f"{final.name}: {off:.2e} from the run that lost nothing; between the groups: {between}; train losses: "
            f"{ {f.name: json.loads(Path(f'{f}.json').read_text())['train_loss'] for f in finals} } against "
            f"{history['train_loss']}; steps per group: { {o.name: len(steps([o])) for o in outs} }"
        )
        kept = json.loads(Path(f"{final}.json").read_text())
        assert kept["train_loss"] == pytest.approx(history["train_loss"], rel=1e-5)
        assert kept["validation_accuracy"] == pytest.approx(history["validation_accuracy"], abs=1e-9)
        # tokens per item over the epoch's committed steps (since the group began or took it): the job's, within
        # what a part of the epoch differs from the whole (a digit's ink varies little)
        ratios = [t / i for t, i in zip(kept["tokens_per_second"], kept["items_per_second"], strict=True)]
        whole = [t / i for t, i in zip(history["tokens_per_second"], history["items_per_second"], strict=True)]
        assert ratios == pytest.approx(whole, rel=0.05), (ratios, whole)


def main(replica: str, lighthouse: str, out: str, kill_at: int, delay: float, checkpoint_dir: str | None) -> None:
    if replica == "-":  # under `ddpkit run --fault-tolerance`: the settings from the environment, OUT a folder
        replica, lighthouse = os.environ["REPLICA_GROUP_ID"], os.environ["TORCHFT_LIGHTHOUSE"]
        loop = build_loop(TorchFT(lighthouse, replica, timeout=5.0, quorum_timeout=30.0))
        loop.out, loop.folder, loop.kill_group = out, True, os.environ.get("FT_KILL_GROUP", "group-2")
        out = os.path.join(out, replica + _rank_suffix())
    else:
        loop = build_loop(TorchFT(lighthouse, replica, timeout=5.0, quorum_timeout=30.0))
        loop.out = out
    if checkpoint_dir is not None:
        loop.checkpoint_dir, loop.checkpoint_every = Path(checkpoint_dir), 7
    loop.kill_at = kill_at
    late = os.environ.get("FT_LATE_RESTART")
    if late and restarted():  # a restart slower than the steps left: it starts once the others have finished
        deadline = time.monotonic() + 120.0
        while not all(os.path.exists(path) for path in late.split(",")) and time.monotonic() < deadline:
            time.sleep(0.1)
    history = loop.fit(EPOCHS, callbacks=[StepLog(delay)])
    weights = loop.full_state_dict()  # every rank of the group; sharded, its rank 0 gets them
    if weights:
        torch.save(weights, f"{out}.pt")
    held = {name: local_tensor(p).numel() / p.numel() for name, p in loop.model.named_parameters()}
    with open(f"{out}.json", "w") as file:
        json.dump({**history, "held": held}, file)


def resume(out: str, checkpoint_dir: str, epochs: int) -> None:
    """``python -m tests.e2e.ft_trainloop resume OUT CHECKPOINT_DIR EPOCHS``, in one process or under
    ``ddpkit run -n N``: the loop with ``FSDPPlugin()`` and no fault tolerance resumes the checkpoint in
    ``CHECKPOINT_DIR`` (a fault-tolerant job's, say) and trains until ``EPOCHS``; rank 0 saves the whole weights
    in ``OUT.pt``."""
    loop = build_loop(None, sharded=True)
    loop.checkpoint_dir = Path(checkpoint_dir)
    loop.fit(epochs)
    weights = loop.full_state_dict()
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(weights, f"{out}.pt")


if __name__ == "__main__" and sys.argv[1] == "resume":
    resume(sys.argv[2], sys.argv[3], int(sys.argv[4]))
elif __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), (sys.argv[6:] or [None])[0])
