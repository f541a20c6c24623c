"""What per-step fault tolerance (torchft) costs and buys, against plain DDP and today's restart path, in one run.

    .venv/bin/pip install -c constraints.txt -e '.[ft]'     # torchft 0.2.0
    python bench/fault_tolerance.py [--steps 300] [--rounds 3] [--step-delay 0.05] [--groups-only | --trainloop-only]

This is the baseline for ddpkit's fault tolerance on torchft, measured before
ddpkit has it: the floor its own per-step cost is set against, and the
recovery it has to keep. Every process is a fresh one, with one thread
(``OMP_NUM_THREADS=1``).

1. **Per-step time** of the digits classifier (64-128-10, batch 32 per
   process, SGD) on 2 CPU processes, in ``--rounds`` alternating rounds of
   ``--steps`` steps (the first 20 of each are warm-up): plain DDP (one gloo
   group, ``DistributedDataParallel``) and a plain torchft loop (2 replica
   groups of one process, a lighthouse, a quorum and a commit per step, the
   gradients all-reduced through ``Manager.allreduce``), and the same loop
   through ddpkit's ``ReplicaGroup``. Ratios: torchft / DDP, ddpkit / torchft
   (what ddpkit adds), ddpkit / DDP (the fault tolerance issue's target: at
   most 1.05). Then a ``TrainLoop`` (global batch 64, 32 per process) as 2
   DDP ranks and as 2 replica groups (``fault_tolerance``: each step's items
   dealt over the quorum, loaded in the process, and the loss sums summed
   over the groups besides the gradients). Then the same ``TrainLoop`` with
   each item 2 ms late (I/O latency), in steps per second: DDP with 2
   DataLoader workers, and fault tolerance with none and with 2 (targets: the
   workers at least 1.5x, and within 10% of DDP with the same loader).
   Then replica groups of 2 ranks on 4 processes (``--groups-only``: these alone): 2 groups as a plain torchft
   loop written for such groups (``Manager(rank=, world_size=2)``, an ``all_reduce`` over the group's ranks,
   then ``Manager.allreduce``) and through ddpkit's ``ReplicaGroup`` (target: at most 1.05x the torchft loop),
   and plain DDP on the same 4 ranks.
2. **Recovery**: from a SIGKILL of one process to the survivors' next
   optimizer step. torchft: 3 replicas, one killed; the survivors keep their
   processes and commit without it; the killed one is started again and heals
   from a peer. Restart path: two ``ddpkit run --nnodes 1:2`` agents running
   ``ddpkit.examples.elastic`` (checkpoint every 5 steps), one killed with its
   agent; torch's elastic agent restarts the survivor's worker, which resumes
   from the last checkpoint. Both with ``--step-delay`` seconds per step.

The loop here does not use torchft's own ``DistributedDataParallel``: in
torchft 0.2.0 its comm hook fails an assertion (``assert fut._fut``, ddp.py) on
the survivors when a peer dies under gloo, so the survivors died instead of
going on. torchft's manager server binds every interface (``[::]``) and its
HTTP checkpoint server does too (and the replica that fetches from it unpickles
what it gets): here the manager is bound to loopback and recovery goes through
the process group (``PGTransport``). Where ``unshare -n`` works (root) the
whole bench runs in a network namespace of its own besides.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

WARM_UP = 20
ITEM_WAIT_S = 0.002
_NETNS = "DDPKIT_BENCH_NETNS"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _digits_step_parts(seed: int, loader: bool = False) -> tuple[Any, Any, Any, Any]:
    """The demo's classifier, SGD, and a batch drawer over the digits training split: 32 items drawn at random
    by indexing the tensors, or (``loader``) the next batch of a ``DataLoader(batch_size=32, shuffle=True)``
    over the split, as a hand-written loop takes them (``TrainLoop`` loads through the same machinery)."""
    import itertools

    import torch
    from torch.utils.data import DataLoader

    from ddpkit.examples.demo import build_model
    from ddpkit.examples.digits import digits_datasets

    train_set = digits_datasets(seed=0)[0]
    images, labels = train_set.tensors
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(seed)
    batches = itertools.chain.from_iterable(
        DataLoader(train_set, batch_size=32, shuffle=True, generator=generator) for _ in itertools.count()
    )

    def batch() -> tuple[Any, Any]:
        if loader:
            return next(batches)  # type: ignore[no-any-return]
        index = torch.randint(0, len(labels), (32,), generator=generator)
        return images[index], labels[index]

    return model, optimizer, batch, torch.nn.functional.cross_entropy


def ddp_worker(rank: int, port: int, steps: int, out: str, world_size: int = 2) -> None:
    """One rank of plain DDP: the time at the end of each step, to ``out`` (JSON lines)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    model, optimizer, batch, loss_of = _digits_step_parts(rank)
    ddp = DistributedDataParallel(model)
    with open(out, "w") as log:
        for step in range(steps):
            x, y = batch()
            optimizer.zero_grad()
            loss_of(ddp(x), y).backward()
            optimizer.step()
            record = {"t": time.time(), "step": step, "committed": True, "participants": world_size}
            log.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


def _plain_manager(replica: str, lighthouse: str, save: Any, load: Any, store_port: int, rank: int, ranks: int
                   ) -> Any:  # fmt: skip
    """torchft's ``Manager`` as a plain torchft loop builds it, its servers on loopback only: rank ``rank`` of a
    replica group of ``ranks`` whose store is on ``store_port``; the manager's server built with a loopback bind
    (torchft 0.2.0 hard-codes ``[::]``), and a recovering replica takes the weights over the replicas' process
    group (torchft's ``PGTransport``), not its HTTP server."""
    import torch
    import torchft.manager
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    server = torchft.manager.ManagerServer

    def on_loopback(*args: Any, **kwargs: Any) -> Any:
        return server(*args, **{**kwargs, "bind": "127.0.0.1:0"})

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    torchft.manager.ManagerServer = on_loopback  # type: ignore[misc]
    try:
        return Manager(
            pg=pg, min_replica_size=1, load_state_dict=load, state_dict=save, replica_id=replica,
            store_addr="127.0.0.1", store_port=store_port, rank=rank, world_size=ranks, lighthouse_addr=lighthouse,
            hostname="127.0.0.1", timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=20),
            connect_timeout=timedelta(seconds=10),
            checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
        )  # fmt: skip
    finally:
        torchft.manager.ManagerServer = server  # type: ignore[misc]


def torchft_worker(replica: str, lighthouse: str, steps: int, out: str, delay: float, loader: bool = False) -> None:
    """One replica group (one process) of a plain torchft loop; each step's time, step, commit and quorum size.
    With ``loader`` its batches come from a ``DataLoader`` (see :func:`_digits_step_parts`).

    Its servers listen on loopback only: the replica group's store is served by ddpkit, the manager's server is
    built with a loopback bind (torchft 0.2.0 hard-codes ``[::]``), and a recovering replica takes the
    weights over the replicas' process group (torchft's ``PGTransport``), not its HTTP server.
    """
    import torch
    from torch.distributed import TCPStore

    from ddpkit._stores import serve_store

    model, optimizer, batch, loss_of = _digits_step_parts(int(replica.removeprefix("r").split("-")[0]), loader)
    store_port = serve_store("127.0.0.1", 0)
    assert store_port is not None
    store = TCPStore("127.0.0.1", store_port, is_master=False, wait_for_workers=False)  # noqa: F841 (kept alive)

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    manager = _plain_manager(replica, lighthouse, save, load, store_port, 0, 1)
    parameters = list(model.parameters())
    with open(out, "w") as log:
        while manager.current_step() < steps:
            x, y = batch()
            optimizer.zero_grad()
            manager.start_quorum()
            loss_of(model(x), y).backward()
            flat = torch.cat([p.grad.reshape(-1) for p in parameters if p.grad is not None])
            manager.allreduce(flat).wait()
            for parameter, part in zip(parameters, torch.split(flat, [p.numel() for p in parameters]), strict=True):
                assert parameter.grad is not None
                parameter.grad.copy_(part.view_as(parameter))
            committed = manager.should_commit()
            if committed:
                optimizer.step()
            record = {"t": time.time(), "step": manager.current_step(), "committed": committed,
                      "participants": manager.num_participants(), "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(delay)
    manager.shutdown(wait=False)


def ddpkit_worker(replica: str, lighthouse: str, steps: int, out: str) -> None:
    """The same loop through ddpkit's ``ReplicaGroup`` (what ``TrainLoop`` will build on)."""
    from ddpkit.fault_tolerance import ReplicaGroup

    model, optimizer, batch, loss_of = _digits_step_parts(int(replica.removeprefix("r").split("-")[0]))

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    group = ReplicaGroup(lighthouse, replica, save, load, timeout=5.0, quorum_timeout=20.0)
    with open(out, "w") as log:
        while group.step < steps:
            group.start_step()
            x, y = batch()
            optimizer.zero_grad()
            loss_of(model(x), y).backward()
            group.average_gradients(model.parameters())
            committed = group.commit()
            if committed:
                optimizer.step()
            record = {"t": time.time(), "step": group.step, "committed": committed,
                      "participants": group.participants, "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(record) + "\n")  # as the torchft loop writes it
            log.flush()
    group.close()


def group_worker(kind: str, group: int, rank: int, port: int, lighthouse: str, steps: int, out: str,
                 delay: float = 0.0) -> None:  # fmt: skip
    """Rank ``rank`` of replica group ``group``, a group of 2 ranks (its own gloo group on ``port``): a plain
    torchft loop written for such groups (``kind`` "torchft": ``Manager(rank=, world_size=2)`` on the group's
    store, the gradients averaged over the group's ranks by ``all_reduce`` and then over the groups by
    ``Manager.allreduce``), or ddpkit's ``ReplicaGroup`` in the group's process group (``kind`` "ddpkit")."""
    import torch
    import torch.distributed as dist

    from ddpkit.fault_tolerance import ReplicaGroup

    if port:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    else:  # under an agent (torchrun, ddpkit run): the group's store and ranks from its variables
        dist.init_process_group("gloo")
        port = int(os.environ["MASTER_PORT"])
    model, optimizer, batch, loss_of = _digits_step_parts(2 * group + rank)
    parameters = list(model.parameters())

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    if kind == "ddpkit":
        replica = ReplicaGroup(lighthouse, f"g{group}", save, load, timeout=5.0, quorum_timeout=20.0)
        start, average, commit = replica.start_step, replica.average_gradients, replica.commit

        def participants() -> int:
            return replica.participants
    else:
        manager = _plain_manager(f"g{group}", lighthouse, save, load, port, rank, 2)

        def average(params: Any) -> bool:
            flat = torch.cat([p.grad.reshape(-1) for p in parameters if p.grad is not None])
            dist.all_reduce(flat)  # over the group's ranks
            flat.div_(2)
            manager.allreduce(flat).wait()  # over the groups
            for parameter, part in zip(parameters, torch.split(flat, [p.numel() for p in parameters]), strict=True):
                assert parameter.grad is not None
                parameter.grad.copy_(part.view_as(parameter))
            return True

        start, commit, participants = manager.start_quorum, manager.should_commit, manager.num_participants
    step = 0
    with open(out, "w") as log:
        while step < steps:
            start()
            x, y = batch()
            optimizer.zero_grad()
            loss_of(model(x), y).backward()
            average(parameters)
            committed = commit()
            if committed:
                optimizer.step()
                step += 1
            record = {"t": time.time(), "step": step, "committed": committed, "participants": participants(),
                      "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(delay)
    if kind == "ddpkit":
        replica.close()
    else:
        manager.shutdown(wait=False)
    dist.destroy_process_group()


def per_step_groups(work: Path, steps: int, rounds: int) -> dict[str, list[float]]:
    """Median seconds per step of each round on 4 processes: plain DDP of 4 ranks, and 2 replica groups of 2
    ranks as a plain torchft loop and through ddpkit's ``ReplicaGroup``."""
    kinds = ("ddp4", "torchft2x2", "ddpkit2x2")
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            outs = [work / f"{kind}-{round_}-{rank}.jsonl" for rank in range(4)]
            logs = [work / f"{kind}-{round_}-{rank}.log" for rank in range(4)]
            lighthouse = _lighthouse(2) if kind != "ddp4" else None
            if lighthouse is None:
                port = str(_free_port())
                args = [["--ddp-worker", str(rank), port, str(steps), str(outs[rank]), "4"] for rank in range(4)]
            else:
                ports = [str(_free_port()) for _ in range(2)]
                args = [["--group-worker", kind.removesuffix("2x2"), str(rank // 2), str(rank % 2), ports[rank // 2],
                         lighthouse.address, str(steps), str(outs[rank])] for rank in range(4)]  # fmt: skip
            _finish([_spawn(a, log) for a, log in zip(args, logs, strict=True)], logs)
            if lighthouse is not None:
                lighthouse.shutdown()
            seconds[kind].append(max(_step_seconds(out) for out in outs))
    return seconds


class _SlowItems:
    """The digits, each item ``wait`` seconds late (I/O latency: a file read, a decode)."""

    def __init__(self, dataset: Any, wait: float) -> None:
        self.dataset, self.wait = dataset, wait

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.wait)
        return self.dataset[index]


def trainloop_worker(kind: str, who: str, address: str, steps: int, out: str, workers: int = 0,
                     wait: float = 0.0) -> None:  # fmt: skip
    """One process of a ``TrainLoop`` on the digits (global batch 64, batches of 32): one of 2 DDP ranks
    (``kind`` "ddp", ``address`` the store's port) or one of 2 replica groups (``kind`` "ft", ``address`` the
    lighthouse); the time at the end of each optimizer step, to ``out``, for ``steps`` steps or a little more.
    The training loader has ``workers`` DataLoader workers and each item waits ``wait`` seconds."""
    import math

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from ddpkit import Callback, TrainLoop
    from ddpkit.examples.demo import build_model
    from ddpkit.examples.digits import digits_datasets
    from ddpkit.fault_tolerance import TorchFT

    if kind == "ddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{address}", rank=int(who), world_size=2)
    train_set, _ = digits_datasets(seed=0)
    torch.manual_seed(0)
    model = build_model()
    # replica_groups=2: the first quorum waits for both groups (one that starts late would find the other alone)
    settings = TorchFT(address, who, timeout=5.0, quorum_timeout=20.0, replica_groups=2)
    fault_tolerance = settings if kind == "ft" else None
    items = _SlowItems(train_set, wait) if wait else train_set
    loop = TrainLoop(model, DataLoader(items, batch_size=32, shuffle=True, num_workers=workers),  # type: ignore[arg-type]
                     optimizer=torch.optim.SGD(model.parameters(), lr=0.05), global_batch_size=64, progress=False,
                     fault_tolerance=fault_tolerance)  # fmt: skip
    with open(out, "w") as log:

        class Times(Callback):
            def on_batch_end(self, train_loop: Any) -> None:
                log.write(json.dumps({"t": time.time(), "step": train_loop.global_step}) + "\n")

        loop.fit(math.ceil(steps / math.ceil(len(train_set) / 64)), callbacks=[Times()])
    if kind == "ddp":
        dist.destroy_process_group()


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)  # fmt: skip


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _step_seconds(path: Path) -> float:
    times = [record["t"] for record in _records(path)][WARM_UP:]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def _finish(processes: list[subprocess.Popen[bytes]], logs: list[Path], timeout: float = 300) -> None:
    for process, log in zip(processes, logs, strict=True):
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        if process.returncode != 0:
            raise RuntimeError(f"{log.name} exited {process.returncode}:\n{log.read_text()[-3000:]}")


def _lighthouse(replicas: int) -> Any:
    """torchft's lighthouse on loopback with the job's record beside it (which ``TrainLoop(fault_tolerance)``
    reads; the plain loops use the lighthouse alone), as ``ddpkit lighthouse`` serves them."""
    from ddpkit.fault_tolerance import serve_lighthouse

    return serve_lighthouse("127.0.0.1", min_replicas=1, join_timeout=0.2 * replicas, heartbeat_timeout=1.0)


def per_step(work: Path, steps: int, rounds: int, kinds: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Median seconds per step of each round, for plain DDP, the plain torchft loop and ddpkit's (``kinds``: those
    alone)."""
    kinds = kinds or ("ddp", "torchft", "ddpkit", "torchft-loader", "trainloop-ddp", "trainloop-ft", "io-ddp-2",
                      "io-ft-0", "io-ft-2")  # fmt: skip
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:
            outs = [work / f"{kind}-{round_}-{rank}.jsonl" for rank in range(2)]
            logs = [work / f"{kind}-{round_}-{rank}.log" for rank in range(2)]
            lighthouse = _lighthouse(2) if kind not in ("ddp", "trainloop-ddp", "io-ddp-2") else None
            if kind.startswith("io-"):  # TrainLoop, each item 2 ms late, with 0 or 2 DataLoader workers
                _, mode, workers = kind.split("-")
                where = str(_free_port()) if lighthouse is None else lighthouse.address
                args = [["--trainloop-worker", mode, f"{rank}" if mode == "ddp" else f"r{rank}-{round_}", where,
                         str(max(steps // 3, WARM_UP + 20)), str(outs[rank]), workers, str(ITEM_WAIT_S)]
                        for rank in range(2)]  # fmt: skip
            elif kind.startswith("trainloop"):
                mode = kind.removeprefix("trainloop-")
                where = str(_free_port()) if lighthouse is None else lighthouse.address
                args = [["--trainloop-worker", mode, f"{rank}" if mode == "ddp" else f"r{rank}-{round_}", where,
                         str(steps), str(outs[rank])] for rank in range(2)]  # fmt: skip
            elif lighthouse is None:
                port = str(_free_port())
                args = [["--ddp-worker", str(rank), port, str(steps), str(outs[rank])] for rank in range(2)]
            else:
                args = [[f"--{kind}-worker", f"r{rank}-{round_}", lighthouse.address, str(steps), str(outs[rank]),
                         "0"] for rank in range(2)]  # fmt: skip
            _finish([_spawn(a, log) for a, log in zip(args, logs, strict=True)], logs)
            if lighthouse is not None:
                lighthouse.shutdown()
            seconds[kind].append(max(_step_seconds(out) for out in outs))
    return seconds


def group_recovery(work: Path, kind: str, delay: float, round_: int = 0) -> float:
    """2 replica groups of 2 ranks (``kind``: "torchft" or "ddpkit", as :func:`group_worker`), each under an agent
    of its own as such groups are run (``torchrun --standalone --nproc-per-node 2``, ``ddpkit run -n 2``; no
    restarts); SIGKILL rank 1 of group 1 after 40 steps committed together: seconds from the kill to group 0's
    next commit (its ranks' later one). The agent stops the dead rank's peer, whose torchft manager server would
    otherwise keep the group in the lighthouse's view (heartbeating) while waiting for the dead rank's vote."""
    lighthouse = _lighthouse(2)
    agent = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              "--max-restarts", "0", "--monitor-interval", "0.1"] if kind == "torchft"
             else [sys.executable, "-m", "ddpkit", "run", "-n", "2", "--max-restarts", "0"])  # fmt: skip
    outs = [work / f"recovery-{kind}-{round_}-{group}" for group in range(2)]
    agents = []
    for group in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "TORCHFT_LIGHTHOUSE": lighthouse.address,
               "REPLICA_GROUP_ID": f"g{group}"}  # fmt: skip
        log = Path(f"{outs[group]}.log")
        command = [*agent, __file__, "--agent-group-worker", kind, str(group), str(outs[group]), str(delay)]
        with open(log, "wb") as output:
            agents.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True))  # fmt: skip
    victim = Path(f"{outs[1]}-1.jsonl")
    _wait_for(lambda: sum(r["committed"] and r["participants"] == 2 for r in _records(victim)) >= 40,
              "40 steps of group 1 committed with group 0")  # fmt: skip
    os.kill(_records(victim)[-1]["pid"], signal.SIGKILL)
    killed = time.time()
    _finish(agents[:1], [Path(f"{outs[0]}.log")])
    if agents[1].poll() is None:
        os.killpg(agents[1].pid, signal.SIGKILL)
    agents[1].wait()
    lighthouse.shutdown()
    survivors = [Path(f"{outs[0]}-{rank}.jsonl") for rank in range(2)]
    return max(min(r["t"] for r in _records(out) if r["committed"] and r["t"] > killed) for out in survivors) - killed


def _wait_for(condition: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited in vain for {what}")
        time.sleep(0.02)


def torchft_recovery(work: Path, delay: float) -> dict[str, Any]:
    """3 replicas; SIGKILL one after 40 committed steps, start it again 2 s later."""
    lighthouse = _lighthouse(3)
    steps = 300  # 13 s after the kill at step 40: time for the restarted replica to start and heal
    outs = [work / f"recovery-r{i}.jsonl" for i in range(3)]
    logs = [work / f"recovery-r{i}.log" for i in range(3)]
    processes = [
        _spawn(["--torchft-worker", f"r{i}", lighthouse.address, str(steps), str(outs[i]), str(delay)], logs[i])
        for i in range(3)
    ]
    pids = [p.pid for p in processes]
    _wait_for(lambda: sum(r["committed"] for r in _records(outs[2])) >= 40, "40 committed steps of replica 2")
    os.killpg(processes[2].pid, signal.SIGKILL)
    killed = time.time()
    processes[2].wait()
    time.sleep(2.0)
    restarted_at = time.time()
    again = work / "recovery-r2-again.jsonl"
    processes[2] = _spawn(["--torchft-worker", "r2", lighthouse.address, str(steps), str(again), str(delay)],
                          work / "recovery-r2-again.log")  # fmt: skip
    _finish(processes, [*logs[:2], work / "recovery-r2-again.log"])
    lighthouse.shutdown()
    survivors = [[r for r in _records(out) if r["t"] > killed] for out in outs[:2]]
    next_commit = max(min(r["t"] for r in rows if r["committed"]) for rows in survivors) - killed
    rejoined = min(r["t"] for r in _records(again) if r["committed"] and r["participants"] == 3) - restarted_at
    kept = all({r["pid"] for r in _records(out)} == {pid} for out, pid in zip(outs[:2], pids[:2], strict=True))
    failed = sum(not r["committed"] for out in outs[:2] for r in _records(out))
    joined_at = min(r["step"] for r in _records(again) if r["committed"])  # past 1: it healed from a peer
    return {"next_commit": next_commit, "rejoined": rejoined, "kept_pids": kept, "failed_steps": failed,
            "joined_at": joined_at}  # fmt: skip


def restart_recovery(work: Path, delay: float) -> dict[str, Any]:
    """Two ``ddpkit run --nnodes 1:2`` agents on ``ddpkit.examples.elastic``; SIGKILL the second (agent and
    worker) at step 10 of epoch 2."""
    from ddpkit.examples.elastic import recorded_steps

    port = _free_port()
    record = work / "elastic-record"
    example = ["-m", "ddpkit.examples.elastic", "--checkpoint-dir", str(work / "elastic-checkpoints"), "--record",
               str(record), "--step-delay", str(delay), "--epochs", "2"]  # fmt: skip
    agent = [sys.executable, "-m", "ddpkit", "run", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
             "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3", "--max-restarts",
             "3", *example]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [work / "elastic-first.log", work / "elastic-second.log"]

    def start(log: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(agent, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    def raw() -> list[dict[str, Any]]:
        paths = record.glob("samples-*.jsonl") if record.exists() else []
        return [json.loads(text) for path in paths for text in path.read_text().splitlines()]

    first = start(logs[0])
    _wait_for(listening, "the first agent's rendezvous store")
    second = start(logs[1])
    _wait_for(lambda: len({r["step"] for r in raw() if (r["epoch"], r["world_size"]) == (1, 2)}) >= 10,
              "step 10 of epoch 2 on two ranks")  # fmt: skip
    os.killpg(second.pid, signal.SIGKILL)
    killed = time.time()
    _finish([first], logs[:1])
    lines = raw()
    next_step = min(line["time"] for line in lines if line["time"] > killed) - killed
    done = len({(line["step"], line["attempt"]) for line in lines if line["rank"] == 0})
    return {"next_step": next_step, "redone_steps": done - len(recorded_steps(record))}


def _inside_netns() -> bool:
    """Re-run this bench in a network namespace of its own when ``unshare -n`` works; True if it did."""
    if os.environ.get(_NETNS) or shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["unshare", "-n", "true"], capture_output=True)
    if probe.returncode != 0:
        return False
    command = f"ip link set lo up && exec {sys.executable} {' '.join(map(repr, sys.argv))}"
    done = subprocess.run(["unshare", "-n", "sh", "-c", command], env={**os.environ, _NETNS: "1"})
    raise SystemExit(done.returncode)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        ddp_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int((sys.argv[6:] or [2])[0]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--agent-group-worker":  # KIND GROUP OUT DELAY, under an agent
        rank = int(os.environ["RANK"])
        group_worker(sys.argv[2], int(sys.argv[3]), rank, 0, os.environ["TORCHFT_LIGHTHOUSE"], 200,
                     f"{sys.argv[4]}-{rank}.jsonl", float(sys.argv[5]))  # fmt: skip
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--group-worker":
        group_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
                     int(sys.argv[7]), sys.argv[8], float((sys.argv[9:] or [0.0])[0]))  # fmt: skip
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("--torchft-worker", "--torchft-loader-worker"):
        loader = sys.argv[1] == "--torchft-loader-worker"
        torchft_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]), loader)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--trainloop-worker":
        io = (int(sys.argv[7]), float(sys.argv[8])) if len(sys.argv) > 8 else (0, 0.0)
        trainloop_worker(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], *io)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--ddpkit-worker":
        ddpkit_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-delay", type=float, default=0.05)
    parser.add_argument("--groups-only", action="store_true", help="only the replica groups of 2 ranks")
    parser.add_argument("--trainloop-only", action="store_true",
                        help="only TrainLoop(fault_tolerance) and a torchft loop with a DataLoader")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse (in this process) logs every quorum at info
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise SystemExit("torchft is not installed: pip install -c constraints.txt -e '.[ft]'") from None
    _inside_netns()
    where = "in a network namespace of its own" if os.environ.get(_NETNS) else "on this machine's network"
    with tempfile.TemporaryDirectory(prefix="ddpkit-ft-bench-") as directory:
        work = Path(directory)
        if args.trainloop_only:
            _print_trainloop(per_step(work, args.steps, args.rounds, ("torchft-loader", "trainloop-ft")), args)
            return
        seconds = {} if args.groups_only else per_step(work, args.steps, args.rounds)
        seconds.update(per_step_groups(work, args.steps, args.rounds))
        recoveries: dict[str, list[float]] = {"torchft": [], "ddpkit": []}
        for round_ in range(args.rounds):  # alternating
            for kind in ("torchft", "ddpkit") if round_ % 2 == 0 else ("ddpkit", "torchft"):
                recoveries[kind].append(group_recovery(work, kind, args.step_delay, round_))
        if args.groups_only:
            _print_groups(seconds, recoveries, args)
            return
        ft = torchft_recovery(work, args.step_delay)
        restart = restart_recovery(work, args.step_delay)
    ddp, torchft_step, ddpkit_step = (statistics.median(seconds[k]) for k in ("ddp", "torchft", "ddpkit"))

    def ratio(top: str, bottom: str) -> str:
        ratios = [t / b for t, b in zip(seconds[top], seconds[bottom], strict=True)]
        return f"{statistics.median(ratios):7.2f}   (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"

    print(f"torchft 0.2.0 on CPU (gloo), {where}; digits 64-128-10, batch 32 per process")
    print(f"per step, 2 processes, {args.rounds} alternating rounds of {args.steps} steps (median of rounds):")
    print(f"  plain DDP                       {ddp * 1e3:7.2f} ms")
    print(f"  plain torchft loop              {torchft_step * 1e3:7.2f} ms  ({(torchft_step - ddp) * 1e3:+.2f} ms)")
    print(f"  ddpkit ReplicaGroup loop        {ddpkit_step * 1e3:7.2f} ms  ({(ddpkit_step - ddp) * 1e3:+.2f} ms)")
    print(f"  ratio torchft / DDP             {ratio('torchft', 'ddp')}")
    print(f"  ratio ddpkit / torchft          {ratio('ddpkit', 'torchft')}")
    print(f"  ratio ddpkit / DDP              {ratio('ddpkit', 'ddp')}  (the issue's target: <= 1.05)")
    loop_ddp, loop_ft = (statistics.median(seconds[k]) for k in ("trainloop-ddp", "trainloop-ft"))
    print("TrainLoop, global batch 64 (32 per process), 2 processes:")
    print(f"  TrainLoop, DDP                  {loop_ddp * 1e3:7.2f} ms")
    print(f"  TrainLoop(fault_tolerance)      {loop_ft * 1e3:7.2f} ms  ({(loop_ft - loop_ddp) * 1e3:+.2f} ms)")
    print(f"  ratio fault tolerance / DDP     {ratio('trainloop-ft', 'trainloop-ddp')}")
    print(f"  ratio TrainLoop(ft) / torchft   {ratio('trainloop-ft', 'torchft')}  (the plain torchft loop above)")
    loader_step = statistics.median(seconds["torchft-loader"])
    print(f"  plain torchft loop, DataLoader  {loader_step * 1e3:7.2f} ms  (batches of 32 from a DataLoader)")
    print(f"  ratio TrainLoop(ft) / that loop {ratio('trainloop-ft', 'torchft-loader')}  (the issue's target: <= 1.05)")
    io_ddp, io_ft0, io_ft2 = (statistics.median(seconds[k]) for k in ("io-ddp-2", "io-ft-0", "io-ft-2"))
    print(f"TrainLoop as above, each item {ITEM_WAIT_S * 1e3:.0f} ms late (I/O), steps/s:")
    print(f"  DDP, 2 DataLoader workers       {1 / io_ddp:7.1f}")
    print(f"  fault tolerance, no workers     {1 / io_ft0:7.1f}")
    print(f"  fault tolerance, 2 workers      {1 / io_ft2:7.1f}")
    print(f"  speed-up of the 2 workers       {ratio('io-ft-0', 'io-ft-2')}  (target >= 1.5)")
    print(f"  fault tolerance / DDP, workers  {ratio('io-ddp-2', 'io-ft-2')}  (steps/s; target >= 0.9)")
    _print_groups(seconds, recoveries, args)
    print(f"recovery from a SIGKILL (step delay {args.step_delay} s):")
    print(f"  torchft, 3 replicas: survivors' next commit {ft['next_commit']:6.2f} s after the kill "
          f"(same processes: {ft['kept_pids']}; steps not committed: {ft['failed_steps']}); the restarted "
          f"replica's first commit was step {ft['joined_at']} (it healed from a peer), with all 3 "
          f"{ft['rejoined']:.2f} s after its start")  # fmt: skip
    print(f"  restart path, ddpkit run --nnodes 1:2: next step {restart['next_step']:6.2f} s after the kill, "
          f"{restart['redone_steps']} step(s) done again (since the last checkpoint)")  # fmt: skip


def _print_trainloop(seconds: dict[str, list[float]], args: argparse.Namespace) -> None:
    ratios = [t / b for t, b in zip(seconds["trainloop-ft"], seconds["torchft-loader"], strict=True)]
    print(f"per step, 2 processes, {args.rounds} alternating rounds of {args.steps} steps (median of rounds):")
    print(f"  plain torchft loop, DataLoader  {statistics.median(seconds['torchft-loader']) * 1e3:7.2f} ms")
    print(f"  TrainLoop(fault_tolerance)      {statistics.median(seconds['trainloop-ft']) * 1e3:7.2f} ms")
    print(f"  ratio TrainLoop(ft) / that loop {statistics.median(ratios):7.2f}   (rounds: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; target <= 1.05)")  # fmt: skip


def _print_groups(seconds: dict[str, list[float]], recoveries: dict[str, list[float]], args: argparse.Namespace
                  ) -> None:  # fmt: skip
    def ratio(top: str, bottom: str) -> str:
        ratios = [t / b for t, b in zip(seconds[top], seconds[bottom], strict=True)]
        return f"{statistics.median(ratios):7.2f}   (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"

    ddp4, plain, ours = (statistics.median(seconds[k]) for k in ("ddp4", "torchft2x2", "ddpkit2x2"))
    print(f"per step, 4 processes, {args.rounds} alternating rounds of {args.steps} steps (median of rounds):")
    print(f"  plain DDP, 4 ranks              {ddp4 * 1e3:7.2f} ms")
    print(f"  plain torchft, 2 groups of 2    {plain * 1e3:7.2f} ms  ({(plain - ddp4) * 1e3:+.2f} ms)")
    print(f"  ddpkit ReplicaGroup, 2 of 2     {ours * 1e3:7.2f} ms  ({(ours - ddp4) * 1e3:+.2f} ms)")
    print(f"  ratio ddpkit / torchft          {ratio('ddpkit2x2', 'torchft2x2')}  (the issue's target: <= 1.05)")
    print(f"  ratio ddpkit / DDP              {ratio('ddpkit2x2', 'ddp4')}")
    plain_s, ours_s = statistics.median(recoveries["torchft"]), statistics.median(recoveries["ddpkit"])
    print(f"recovery, 2 groups of 2, rank 1 of one group SIGKILLed (step delay {args.step_delay} s), the other's "
          f"next commit after the kill (median of {args.rounds}):")  # fmt: skip
    each = {kind: ", ".join(f"{x:.2f}" for x in values) for kind, values in recoveries.items()}
    print(f"  plain torchft loop              {plain_s:6.2f} s  (each: {each['torchft']})")
    print(f"  ddpkit ReplicaGroup             {ours_s:6.2f} s  (each: {each['ddpkit']})")
    print(f"  ratio ddpkit / torchft          {ours_s / plain_s:7.2f}   (the issue's target: <= 1.1)")


if __name__ == "__main__":
    main()
