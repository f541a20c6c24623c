"""The chaos suite: a fault-tolerant ``TrainLoop`` job under ``ddpkit run --fault-tolerance`` and a seeded schedule of
faults (kills, a kill right after a group comes back, SIGSTOP stalls, two groups killed together), then the checks:
exit status, no step committed twice, every item once per epoch, the weights of one process, and the longest
silence of every live group.

``tests/e2e/test_chaos.py`` runs a few seeds; ``tools/chaos.py`` runs many (the soak) and prints the figures.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import FSDPPlugin, TrainLoop
from ddpkit._trust.secret import write_secret_file
from ddpkit.examples.demo import build_model
from ddpkit.examples.digits import digits_datasets
from ddpkit.fault_tolerance import TorchFT

GLOBAL_BATCH = 64
BATCH = 16
#: Committed steps per epoch of the digits' 1438 training items in global batches of 64.
STEPS_PER_EPOCH = 23
#: The longest a live group may go without committing a step, outside its own stall (seconds).
LONGEST_SILENCE_S = 10.0
#: The kinds of fault; every seed's schedule has each of them once, in a seeded order (and, with 4 groups or more,
#: ``kill-all-but-one`` too: with 3, that is ``kill-together``).
KINDS = ("kill", "kill-again", "stop", "kill-together")


def process_name() -> str:
    """``<replica group>.rank<r>``: this rank's name in the chaos job's folder."""
    return f"{os.environ.get('REPLICA_GROUP_ID', 'one')}.rank{os.environ.get('RANK', '0')}"


class ChaosLoop(TrainLoop):
    """Batches ``(images, labels, indices)``; each attempt's indices kept in :attr:`pending` (an attempt not
    committed, or a share dealt again, is left out of the log); :meth:`write` appends a JSON line to the log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[tuple[int, int, int], list[int]]] = []
        self.log_path = ""
        self._file: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.log_path:
            return
        if self._file is None:
            self._file = open(self.log_path, "a")  # noqa: SIM115  # open while the process trains
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        images, labels, indices = batch
        self.pending.append(((self.global_step, self.state.failed_steps, self.state.dealt_again), indices.tolist()))
        return nn.functional.cross_entropy(model(images), labels)


def chaos_loop(fault_tolerant: bool) -> ChaosLoop:
    """The same loop in every group and in the one-process reference run (weights, order, optimizer); with
    ``$CHAOS_PLUGIN=fsdp`` each group shards the model over its ranks (``FSDPPlugin()``)."""
    train_set, val_set = digits_datasets(seed=0)
    images, labels = train_set.tensors
    indexed = TensorDataset(images, labels, torch.arange(len(labels)))
    torch.manual_seed(0)
    model = build_model()
    return ChaosLoop(
        model, DataLoader(indexed, batch_size=BATCH, shuffle=True), DataLoader(val_set, batch_size=100),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), global_batch_size=GLOBAL_BATCH,
        progress=False, fault_tolerance=TorchFT(timeout=5.0, quorum_timeout=30.0) if fault_tolerant else None,
        plugin=FSDPPlugin() if fault_tolerant and os.environ.get("CHAOS_PLUGIN") == "fsdp" else None,
    )  # fmt: skip


@dataclass(frozen=True)
class Fault:
    """A fault of the schedule: at the job's committed step ``at``, ``kind`` on ``groups`` (indices)."""

    at: int
    kind: str
    groups: tuple[int, ...]
    #: A stall's length, or the time between two kills together (seconds).
    seconds: float = 0.0

    def __str__(self) -> str:
        targets = "+".join(f"group-{g}" for g in self.groups)
        length = f" for {self.seconds:.1f} s" if self.kind == "stop" else f" {self.seconds:.2f} s apart"
        return f"{self.kind} {targets} at step {self.at}" + (length if self.seconds else "")


def schedule(seed: int, groups: int, steps: int) -> list[Fault]:
    """Seed ``seed``'s faults for a job of ``groups`` replica groups and ``steps`` committed steps: each kind of
    :data:`KINDS` once, in a seeded order, 12 to 30 steps apart from step 8 on; each on seeded groups (two at once
    for ``kill-together``, all but one for ``kill-all-but-one``, each up to 0.45 s after the last; a stall of
    4-8 s for ``stop``)."""
    rng = random.Random(seed)
    kinds = [*KINDS, *(["kill-all-but-one"] if groups > 3 else [])]
    rng.shuffle(kinds)
    faults, at = [], 8 + rng.randrange(8)
    for kind in kinds:
        count = {"kill-together": 2, "kill-all-but-one": groups - 1}.get(kind, 1)
        targets = tuple(sorted(rng.sample(range(groups), count)))
        # A stall of 4-8 s; two kills up to 0.45 s apart.
        seconds = round(rng.uniform(4.0, 8.0) if kind == "stop" else rng.uniform(0.0, 0.45) * min(count - 1, 1), 2)
        faults.append(Fault(min(at, steps - 8), kind, targets, seconds))
        at += rng.randrange(12, 31)
    return faults


@dataclass
class Event:
    """What the harness did: ``kind`` (``kill``, ``stop``, ``cont``) to ``group``'s process ``pid`` at ``t``."""

    t: float
    kind: str
    group: int
    pid: int
    fault: str


@dataclass
class ChaosRun:
    """One chaos run: its command's exit status and output, the faults fired, and every rank's log."""

    seed: int
    groups: int
    epochs: int
    folder: Path
    status: int | None = None
    output: str = ""
    seconds: float = 0.0
    events: list[Event] = field(default_factory=list)
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def commits(self) -> Iterator[tuple[str, dict[str, Any]]]:
        for name, records in self.records.items():
            for record in records:
                if "step" in record:
                    yield name, record


def _read_records(folder: Path) -> dict[str, list[dict[str, Any]]]:
    found = {}
    for path in sorted(folder.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        found[path.stem] = [json.loads(line) for line in lines if line.endswith("}")]
    return found


def _current_pid(folder: Path, group: int) -> int | None:
    try:
        return int(json.loads((folder / f"group-{group}.rank0.pid").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def run_chaos(seed: int, folder: Path, *, groups: int = 3, epochs: int = 6, delay: float = 0.1,
              timeout: float = 400.0, endpoint: str | None = None, group_size: int = 1) -> ChaosRun:  # fmt: skip
    """Run the chaos job of seed ``seed`` in ``folder`` and fire its schedule; the run, whatever happened (the
    checks are :func:`check_chaos`'s). The job is ``ddpkit run --fault-tolerance -n groups`` on this machine, or,
    with ``endpoint`` (``HOST:PORT``, an address of this machine), one ``ddpkit run --fault-tolerance --nnodes
    groups`` command per group as on several nodes, each with a checkpoint directory of its own (the first
    serves the lighthouse there). With ``group_size`` above 1 (on one machine), each group has that many ranks;
    the faults hit each group's rank 0 (its agent then starts all its ranks again)."""
    folder.mkdir(parents=True, exist_ok=True)
    faults = schedule(seed, groups, epochs * STEPS_PER_EPOCH)
    job = ["-m", "tests.e2e.chaos_job", str(folder), str(epochs), str(delay)]
    if endpoint is None:
        commands = [[sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", str(groups * group_size),
                     "--group-size", str(group_size), "--max-restarts", "12", *job,
                     str(folder / "checkpoints")]]  # fmt: skip
    else:
        secret = folder / "secret"
        write_secret_file(str(secret))
        commands = [[sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "--nnodes", str(groups), "-n", "1",
                     "--rdzv-endpoint", endpoint, "--secret-file", str(secret), "--replica-id", f"group-{group}",
                     "--max-restarts", "12", *job, str(folder / f"checkpoints-{group}")]
                    for group in range(groups)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    env.pop("DDPKIT_JOB_SECRET", None)
    run = ChaosRun(seed, groups, epochs, folder)
    began = time.monotonic()
    outputs = [folder / f"output-{number}.txt" for number in range(len(commands))]
    processes = []
    for command, path in zip(commands, outputs, strict=True):
        with open(path, "wb") as output:
            processes.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))  # fmt: skip
        if endpoint is not None and len(processes) == 1:  # the node that serves the lighthouse first
            _wait_for_line(path, "lighthouse at", 60.0)
    try:
        _fire(run, processes, faults, began + timeout)
        for process in processes:
            process.wait(timeout=max(1.0, began + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    finally:
        for event in run.events:  # nothing stays stopped
            if event.kind == "stop":
                _signal(event.pid, signal.SIGCONT)
    statuses = [process.returncode for process in processes]
    run.status = next((status for status in statuses if status != 0), 0)
    run.seconds = time.monotonic() - began
    run.output = "\n".join(path.read_text(errors="replace") for path in outputs)
    run.records = _read_records(folder)
    return run


def _wait_for_line(path: Path, text: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and text not in path.read_text(errors="replace"):
        time.sleep(0.1)


def _signal(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return False
    return True


def _fire(run: ChaosRun, processes: list[subprocess.Popen[bytes]], faults: list[Fault], deadline: float) -> None:
    """Fire each fault once the job has committed its step and every group is up (its process committed a step
    since it started), until the command ends."""
    pending = list(faults)
    again: dict[int, tuple[int, str]] = {}  # group -> (the pid killed, the fault): kill its next process once back
    while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
        records = _read_records(run.folder)
        step = max((r["step"] + 1 for rs in records.values() for r in rs if "step" in r), default=0)
        # Not up: a process killed (until its group's next one committed a step), or stopped (until it wakes): a
        # fault while one is stopped could leave no process that holds the job's newest state.
        down = {e.pid for e in run.events if e.kind == "kill"} | _stopped(run)
        up = {g: _up(records, run.folder, g, down) for g in range(run.groups)}
        for group, (killed, why) in list(again.items()):
            pid = up[group]
            if pid is not None and pid != killed:  # back, and it committed a step: kill it again at once
                _kill(run, group, pid, why + " (again, right after it came back)")
                del again[group]
                up[group] = None
        if not pending or pending[0].at > step or not all(up.values()):
            continue
        fault = pending.pop(0)
        pids = {g: up[g] for g in fault.groups}
        for number, (group, pid) in enumerate(pids.items()):
            assert pid is not None
            if number and fault.kind.startswith("kill-") and fault.kind != "kill-again":
                time.sleep(fault.seconds)
            if fault.kind == "stop":
                _stop(run, group, pid, fault)
            else:
                _kill(run, group, pid, str(fault))
                if fault.kind == "kill-again":
                    again[group] = (pid, str(fault))


def _stopped(run: ChaosRun) -> set[int]:
    """The processes stopped and not yet woken."""
    stopped: set[int] = set()
    for event in run.events:
        if event.kind == "stop":
            stopped.add(event.pid)
        elif event.kind == "cont":
            stopped.discard(event.pid)
    return stopped


def _up(records: dict[str, list[dict[str, Any]]], folder: Path, group: int, down: set[int]) -> int | None:
    """The process of ``group`` (its rank 0) while it holds the job's state (it committed the job's last step, or
    the one before), else ``None`` (also while the process it names is ``down``)."""
    pid = _current_pid(folder, group)
    if pid is None or pid in down:
        return None
    last = max((r["step"] for rs in records.values() for r in rs if "step" in r), default=0)
    mine = records.get(f"group-{group}.rank0", [])
    return pid if any(r.get("pid") == pid and r.get("step", -2) >= last - 1 for r in mine) else None


def _kill(run: ChaosRun, group: int, pid: int, why: str) -> None:
    if _signal(pid, signal.SIGKILL):
        run.events.append(Event(time.time(), "kill", group, pid, why))


def _stop(run: ChaosRun, group: int, pid: int, fault: Fault) -> None:
    if not _signal(pid, signal.SIGSTOP):
        return
    run.events.append(Event(time.time(), "stop", group, pid, str(fault)))

    def wake() -> None:
        time.sleep(fault.seconds)
        if _signal(pid, signal.SIGCONT):
            run.events.append(Event(time.time(), "cont", group, pid, str(fault)))

    threading.Thread(target=wake, daemon=True).start()


_REFERENCE: dict[int, tuple[dict[str, torch.Tensor], dict[str, list[float]]]] = {}


def reference(epochs: int) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """The weights and history of one process trained on the same global batches (computed once per epochs)."""
    if epochs not in _REFERENCE:
        loop = chaos_loop(fault_tolerant=False)
        history = loop.fit(epochs)
        _REFERENCE[epochs] = ({k: v.clone() for k, v in loop.model.state_dict().items()}, history)
    return _REFERENCE[epochs]


def _stalls(run: ChaosRun) -> dict[int, list[tuple[float, float]]]:
    """Each process's stalls, ``(stopped, woken)`` (woken: the end of the run where it was never woken)."""
    stalls: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in run.events:
        if event.kind == "stop":
            woken = next((e.t for e in run.events if e.kind == "cont" and e.pid == event.pid and e.t > event.t),
                         time.time())  # fmt: skip
            stalls[event.pid].append((event.t, woken))
    return stalls


def check_chaos(run: ChaosRun) -> dict[str, Any]:
    """Assert what the chaos suite guarantees of ``run``; its figures (the longest silence, the gaps after each
    fault, steps committed, restarts)."""
    tail = run.output[-4000:]
    assert run.status == 0, f"seed {run.seed}: the job ended with status {run.status}:\n{tail}"
    commits = list(run.commits())
    # No step committed twice: every record of a step names the same quorum, and its process is in it.
    quorums: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    for _, record in commits:
        quorums[record["step"]].add(tuple(record["members"]))
    twice = {step: sorted(q) for step, q in quorums.items() if len(q) > 1}
    assert not twice, f"seed {run.seed}: steps committed by more than one quorum: {dict(list(twice.items())[:3])}"
    total = run.epochs * STEPS_PER_EPOCH
    assert sorted(quorums) == list(range(total)), (
        f"seed {run.seed}: steps committed {sorted(set(range(total)) - set(quorums))[:10]} missing"
    )
    # Every item once per epoch. A member of a step's quorum killed after the step's all-reduce but before it wrote
    # its record (its commit is its own, the others committed with its gradients) leaves its share unlogged: the
    # items never logged must be exactly as many as those shares hold, and no item is logged twice.
    weights, _ = reference(run.epochs)
    items = 1438
    records: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for _, record in commits:
        records[record["step"]].append(record)
    unlogged: Counter[int] = Counter()  # by epoch: items of committed shares whose process wrote no record
    for step, written in records.items():
        if len(written) < len(written[0]["members"]):
            size = min(GLOBAL_BATCH, items - (step % STEPS_PER_EPOCH) * GLOBAL_BATCH)
            unlogged[written[0]["epoch"]] += size - sum(len(r["items"]) for r in written)
    for epoch in range(run.epochs):
        counted = Counter(i for _, r in commits if r["epoch"] == epoch for i in r["items"])
        assert set(counted.values()) <= {1}, f"seed {run.seed}, epoch {epoch}: used twice: {counted.most_common(3)}"
        assert set(counted) <= set(range(items)), f"seed {run.seed}, epoch {epoch}: items out of range"
        never = items - len(counted)
        assert never == unlogged[epoch], (
            f"seed {run.seed}, epoch {epoch}: {never} items never used ({sorted(set(range(items)) - set(counted))[:10]}"
            f"...), {unlogged[epoch]} in shares of members killed before they wrote their record"
        )
    # Every group that ended with weights has those of one process.
    finals = sorted(run.folder.glob("group-*.rank0.pt"))
    assert finals, f"seed {run.seed}: no group ended with its weights:\n{tail}"
    for final in finals:
        ended = torch.load(final)
        off = max(float((ended[k] - weights[k]).abs().max()) for k in weights)
        assert off < 1e-5, f"seed {run.seed}: {final.name} is {off:.2e} from one process"
    # Silences: between two commits of one process, outside its own stalls.
    stalls = _stalls(run)
    longest, where = 0.0, ""
    by_pid: dict[int, list[float]] = defaultdict(list)
    for _, record in commits:
        by_pid[record["pid"]].append(record["t"])
    for pid, times in by_pid.items():
        times.sort()
        for before, after in itertools.pairwise(times):
            # A stall's own time does not count; what follows it (noticing, taking the state back) does.
            begun = max([before, *(woken for stopped, woken in stalls.get(pid, []) if before < woken < after)])
            if after - begun > longest:
                longest, where = after - begun, f"process {pid}, {begun - times[0]:.1f} s after its first commit"
    assert longest <= LONGEST_SILENCE_S, f"seed {run.seed}: a live group was silent {longest:.1f} s ({where})"
    # After each fault, the groups it left alone commit within the same bound; during a stall, the others go on.
    after_fault = []
    for event in (e for e in run.events if e.kind in ("kill", "stop")):
        hit = {e.pid for e in run.events if e.fault == event.fault and e.kind in ("kill", "stop")}
        nxt = min((r["t"] for _, r in commits if r["t"] > event.t and r["pid"] not in hit), default=None)
        if nxt is not None:
            after_fault.append(nxt - event.t)
            assert nxt - event.t <= LONGEST_SILENCE_S, (
                f"seed {run.seed}: {event.fault}: next commit {nxt - event.t:.1f} s later"
            )
    return {
        "seed": run.seed, "seconds": round(run.seconds, 1), "longest_silence": round(longest, 2),
        "after_fault": [round(t, 2) for t in after_fault], "kills": sum(e.kind == "kill" for e in run.events),
        "stops": sum(e.kind == "stop" for e in run.events),
    }  # fmt: skip
