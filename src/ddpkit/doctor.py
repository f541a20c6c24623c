"""``ddpkit doctor``: does every rank reach every other, and how fast are all_reduce and all_gather?

:func:`check_ranks` runs on every rank of a process group: each rank sends a
message to every other rank (point to point, with a deadline) and reports whom
it heard from through the group's store, which works even when some pairs of
ranks cannot talk. When every pair can, it times ``all_reduce`` and
``all_gather`` on small messages (latency) and large ones (bandwidth). The CLI
starts it like any job: ``ddpkit doctor -n 2`` or ``ddpkit run -n 2 --doctor``
(several nodes, ``srun`` and ``mpirun`` as for ``ddpkit run``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit._trust.sealed import SealedKeys
from ddpkit.connection import group_keys
from ddpkit.process_group import get_rank, get_world_size

__all__ = ["DoctorReport", "Measurement", "check_ranks", "format_bytes"]

#: Result sizes, in bytes per rank: small ones measure latency, large ones bandwidth.
SMALL_SIZES = (8, 1024, 64 * 1024)
LARGE_SIZES = (1 << 20, 16 << 20)
_PREFIX = "ddpkit-doctor"
#: How many times this process called :func:`check_ranks` (every rank calls it as often: the key of a call).
_calls = 0


@dataclass(frozen=True)
class Measurement:
    """One timed collective.

    Attributes:
        operation: ``"all_reduce"`` or ``"all_gather"``.
        nbytes: bytes of the result on each rank (for ``all_gather``, all ranks'
            parts together).
        seconds: time per operation, the slowest rank's mean, in seconds.
        world_size: ranks that took part.
    """

    operation: str
    nbytes: int
    seconds: float
    world_size: int

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, in bytes per second: ``nbytes / seconds``."""
        return self.nbytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bus bandwidth, in bytes per second (nccl-tests' convention: comparable across world sizes):
        ``algbw * 2(W-1)/W`` for all_reduce, ``algbw * (W-1)/W`` for all_gather."""
        w = self.world_size
        factor = 2 * (w - 1) / w if self.operation == "all_reduce" else (w - 1) / w
        return self.algbw * factor

    @property
    def is_latency(self) -> bool:
        """A small message: the time is the latency, the bandwidth means little."""
        return self.nbytes < LARGE_SIZES[0]


@dataclass(frozen=True)
class DoctorReport:
    """What :func:`check_ranks` found (rank 0's copy).

    Attributes:
        world_size: ranks in the group.
        backend: the group's backend.
        master: ``MASTER_ADDR:MASTER_PORT`` of the group's store.
        heard_from: ``{rank: ranks it received a message from}``; a rank missing
            here reported nothing (it hung, or the store could not hear from it).
        connectivity_seconds: time of the message exchange on rank 0, in seconds.
        measurements: the timed collectives (empty when connectivity failed).
    """

    world_size: int
    backend: str
    master: str
    heard_from: dict[int, list[int]]
    connectivity_seconds: float
    measurements: list[Measurement] = field(default_factory=list)

    @property
    def silent_ranks(self) -> list[int]:
        """Ranks that reported nothing."""
        return [r for r in range(self.world_size) if r not in self.heard_from]

    @property
    def unreachable(self) -> list[tuple[int, int]]:
        """``(sender, receiver)`` pairs whose message did not arrive, among the ranks that reported."""
        return [
            (sender, receiver)
            for receiver, senders in sorted(self.heard_from.items())
            for sender in range(self.world_size)
            if sender != receiver and sender not in senders
        ]

    @property
    def ok(self) -> bool:
        """Every rank reported and every message arrived."""
        return not self.silent_ranks and not self.unreachable

    def format(self) -> str:
        """The report as text: a connectivity line, a diagnosis or a table with units."""
        pairs = self.world_size * (self.world_size - 1)
        lines = [f"ddpkit doctor: {self.world_size} ranks, backend {self.backend}, store at {self.master}"]
        if self.ok:
            lines.append(
                f"connectivity: ok, each rank received a message from every other rank ({pairs} ordered pairs, "
                f"{self.connectivity_seconds * 1e3:.1f} ms)"
            )
        else:
            lines.append("connectivity: FAILED")
            for rank in self.silent_ranks:
                lines.append(f"  rank {rank} reported nothing: it hung or cannot reach the store at {self.master}")
            for sender, receiver in self.unreachable:
                lines.append(f"  rank {sender} -> rank {receiver}: no message arrived")
            lines.append(
                "  check that the hosts of these ranks can open TCP connections to each other (firewalls, the "
                "network interface: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)"
            )
        if self.measurements:
            lines.append("")
            lines.append(f"{'operation':<12}{'size/rank':>11}{'time/op':>12}{'algbw':>13}{'busbw':>13}")
            for m in self.measurements:
                bandwidth = ("-", "-") if m.is_latency else (f"{m.algbw / 1e9:.3f} GB/s", f"{m.busbw / 1e9:.3f} GB/s")
                lines.append(
                    f"{m.operation:<12}{format_bytes(m.nbytes):>11}{_format_seconds(m.seconds):>12}"
                    f"{bandwidth[0]:>13}{bandwidth[1]:>13}"
                )
            lines.append("size/rank: bytes of the result on each rank; time/op: slowest rank's mean; GB = 1e9 bytes")
        return "\n".join(lines)


def check_ranks(peer_timeout: float = 10.0, repeats: int = 1) -> DoctorReport | None:
    """Check connectivity and time the collectives; every rank of the default group must call it.

    Args:
        peer_timeout: seconds to wait for each peer's message (and for every
            rank's report on rank 0).
        repeats: multiply the number of timed iterations (default 1: a few
            seconds in all on a small machine).

    Returns:
        The report on rank 0, ``None`` on the other ranks.

    Raises:
        RuntimeError: there is no process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("check_ranks needs a process group: run it under `ddpkit doctor` or ddpkit.launch")
    rank, world_size = get_rank(), get_world_size()
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # Keys of this call only: the store outlives a call. Every rank calls it as often (no counter in the store,
    # which a stranger could add to); each value is signed for the group with a job secret.
    global _calls
    call, _calls = _calls, _calls + 1
    keys = group_keys(_PREFIX)
    started = time.perf_counter()
    heard = _exchange_messages(rank, world_size, device, peer_timeout)
    connectivity = time.perf_counter() - started
    keys.put(f"{call}/heard-from/{rank}", ",".join(map(str, heard)).encode())
    report = None
    if rank == 0:
        heard_from = _collect(keys, f"{call}/heard-from", world_size, peer_timeout)
        report = DoctorReport(world_size, backend, _master(), heard_from, connectivity)
    # Measure only when every pair works (else a collective could hang): rank 0 tells the others.
    verdict = "measure" if report is not None and report.ok else "stop"
    if rank == 0:
        keys.put(f"{call}/verdict", verdict.encode())
    else:
        verdict = (_wait_for(keys, f"{call}/verdict", peer_timeout * 2) or b"stop").decode()
    if verdict != "measure":
        return report
    measurements = [
        _time(operation, nbytes, world_size, device, repeats)
        for operation in ("all_reduce", "all_gather")
        for nbytes in (*SMALL_SIZES, *LARGE_SIZES)
    ]
    if report is None:
        return None
    return DoctorReport(report.world_size, report.backend, report.master, report.heard_from, connectivity, measurements)


def format_bytes(nbytes: int) -> str:
    """``8 B``, ``1 KiB``, ``16 MiB``."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def _format_seconds(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.2f} ms"


def _exchange_messages(rank: int, world_size: int, device: torch.device, timeout: float) -> list[int]:
    """Send this rank's number to every other rank and receive theirs; the ranks heard from."""
    heard = []
    for offset in range(1, world_size):
        peer_to, peer_from = (rank + offset) % world_size, (rank - offset) % world_size
        outgoing = torch.tensor([rank], dtype=torch.int64, device=device)
        incoming = torch.tensor([-1], dtype=torch.int64, device=device)
        try:
            works = [dist.isend(outgoing, peer_to), dist.irecv(incoming, peer_from)]
            for work in works:
                if work is not None:
                    work.wait(timedelta(seconds=timeout))
        except RuntimeError:
            continue
        if int(incoming.item()) == peer_from:
            heard.append(peer_from)
    return sorted(heard)


def _collect(keys: SealedKeys, prefix: str, world_size: int, timeout: float) -> dict[int, list[int]]:
    """Every rank's list of senders, as far as the store has them (from the group's ranks) after ``timeout``."""
    heard: dict[int, list[int]] = {}
    deadline = time.monotonic() + timeout
    for rank in range(world_size):
        value = _wait_for(keys, f"{prefix}/{rank}", max(0.1, deadline - time.monotonic()))
        if value is not None:
            heard[rank] = [int(r) for r in value.decode().split(",") if r]
    return heard


def _wait_for(keys: SealedKeys, key: str, timeout: float) -> bytes | None:
    """The group's value of ``key`` once it is there (a stranger's does not count), or ``None`` after ``timeout``
    seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = keys.read(key)
        if value is not None or time.monotonic() >= deadline:
            return value
        time.sleep(0.02)


def _master() -> str:
    import os

    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def _time(operation: str, nbytes: int, world_size: int, device: torch.device, repeats: int) -> Measurement:
    """Mean time of ``operation`` producing ``nbytes`` per rank; the slowest rank's."""
    if operation == "all_reduce":
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        outputs: list[torch.Tensor] = []
    else:
        part = max(1, nbytes // 4 // world_size)
        tensor = torch.zeros(part, dtype=torch.float32, device=device)
        outputs = [torch.empty_like(tensor) for _ in range(world_size)]
    iterations = repeats * (50 if nbytes < LARGE_SIZES[0] else 5)

    def once() -> None:
        if operation == "all_reduce":
            dist.all_reduce(tensor)
        else:
            dist.all_gather(outputs, tensor)

    for _ in range(2):
        once()
    _synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iterations):
        once()
    _synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / iterations], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    result_bytes = tensor.numel() * 4 * (1 if operation == "all_reduce" else world_size)
    return Measurement(operation, result_bytes, float(elapsed.item()), world_size)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
