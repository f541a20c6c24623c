"""A fault-tolerant job's record, kept beside its lighthouse: how far the job got (the highest step a quorum
committed, and the processes of that quorum, which hold the job's state), and whether it finished or cannot go
on. It outlives every replica group: a group that starts or comes back reads it before it trains, and every
group reads it at each new quorum (:mod:`ddpkit.fault_tolerance._quorums` judges the quorum by it).

The record is a torch ``TCPStore`` served in the lighthouse's process, on the lighthouse's address and the next
port (:data:`RECORD_PORT_OFFSET`): wherever a group finds the lighthouse, it finds the record. Its server draws
an id for the job when it starts, and gives it to each process that asks with a fresh nonce, signed with the job
secret for that nonce (so an answer recorded from an earlier job does not pass); the record's value is signed
for that id (:class:`~ddpkit._trust.sealed.SealedKeys`): nothing a stranger writes there, and nothing copied from
another job with the same secret, is read as the job's. Without a secret, values are plain (a loopback job).
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit._stores import release_store, serve_store
from ddpkit._trust.sealed import SealedKeys
from ddpkit._trust.secret import GUIDE, secret_source
from ddpkit.errors import DDPKitError
from ddpkit.fault_tolerance._torchft import bracketed, url_host

__all__ = [
    "RECORD_PORT_OFFSET",
    "JobRecord",
    "LocalRecord",
    "Record",
    "RecordServer",
    "RecordUnreachableError",
    "UnsignedRecordError",
    "record_address",
]

log = logging.getLogger(__name__)

#: The record listens on the lighthouse's port plus this.
RECORD_PORT_OFFSET = 1
_KEY = "ddpkit/job"
_ASKS = "ddpkit/asks"
#: Seconds the server waits for an ask whose number was drawn before it answers the next (a stranger's gap).
_GAP_S = 5.0
#: Seconds between two looks at a key that is awaited.
_POLL_S = 0.02
#: Seconds between two writes of the noted commits (the newest note then): the record lags the job by so much.
_NOTE_EVERY_S = 0.05
#: Seconds between two beats of a replica group's rank (its counter in the record's store goes up by one).
BEAT_S = 0.25
#: Seconds a rank's beat may stand still before the others count it as stalled (stopped, or gone).
STALLED_S = 2.0


class RecordUnreachableError(DDPKitError):
    """The job's record beside the lighthouse cannot be reached or read (gone with the lighthouse, or never
    served there)."""


class UnsignedRecordError(RecordUnreachableError):
    """The job's record answers without the job secret that this process holds (the lighthouse's process was
    given none): nothing in it can be told from what a stranger wrote."""


@dataclass(frozen=True)
class Record:
    """What the job's record says.

    Attributes:
        generation: how many times the job went back to an older state (every holder of the newest was lost).
        step: the highest step a quorum committed, in torchft's count (``ReplicaGroup.step``); 0: none yet.
        holders: the processes of the quorum that committed it (torchft's ``NAME:uuid``): they hold the state.
        finished: ``(step, replica id)`` once a group trained the job's last step, else ``None``.
        failed: why the job cannot go on, once a quorum found that, else ``None``.
        started: whether the job's first quorum went ahead (every group of the job in it, or its wait over): no
            later quorum waits for the job's groups.
        ranks: ``(replica id, ranks)`` of each group that joined the job (its rank 0 writes it as it joins).
    """

    generation: int = 0
    step: int = 0
    holders: tuple[str, ...] = ()
    finished: tuple[int, str] | None = None
    failed: str | None = None
    started: bool = False
    ranks: tuple[tuple[str, int], ...] = ()

    def with_ranks(self, replica_id: str, ranks: int) -> Record | None:
        """This record with group ``replica_id`` of ``ranks`` ranks, or ``None`` when it says so already."""
        if (replica_id, ranks) in self.ranks:
            return None
        return replace(self, ranks=(*((name, n) for name, n in self.ranks if name != replica_id), (replica_id, ranks)))

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Record:
        said = json.loads(data)
        finished = said.get("finished")
        return cls(
            int(said["generation"]), int(said["step"]), tuple(str(h) for h in said["holders"]),
            None if finished is None else (int(finished[0]), str(finished[1])),
            None if said.get("failed") is None else str(said["failed"]), bool(said.get("started", False)),
            tuple((str(name), int(ranks)) for name, ranks in said.get("ranks", ())),
        )  # fmt: skip


def record_address(lighthouse: str) -> tuple[str, int]:
    """Where the record of the job whose lighthouse is at ``lighthouse`` (``http://HOST:PORT``) listens."""
    host = url_host(lighthouse)
    port = int(lighthouse.rstrip("/").rpartition(":")[2])
    return host, port + RECORD_PORT_OFFSET


#: What the server's answers are signed for (each is bound to its nonce besides).
_HANDSHAKE = "ddpkit job record handshake v1"


class RecordServer:
    """The job's record, served on ``host:port`` in this process (beside the lighthouse) until :meth:`close`.

    Raises:
        PortTakenError: another program holds the port.
    """

    def __init__(self, host: str, port: int, secret: bytes | None) -> None:
        served = serve_store(host, port)
        if served is None:
            raise ValueError(f"{host} is not an address of this machine: the job's record cannot listen there")
        self.port, self.host = served, host
        #: The job's id: the record's values are signed for it.
        self.job = secrets.token_hex(16)
        self._secret = secret
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, name="ddpkit-job-record", daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        """Answer each process's question (its nonce, under ``ddpkit/ask/N``) with the job's id, signed for the
        nonce; skip a number that nobody wrote for :data:`_GAP_S` seconds while later ones were drawn."""
        try:
            store = TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=30))
        except Exception as exc:  # closed before it started
            log.debug("the job record's server could not connect to its own store: %s", exc)
            return
        keys = SealedKeys(store, self._secret, _HANDSHAKE)
        number, missing_since = 1, None
        while not self._stop.wait(_POLL_S):  # polled: a store's wait that times out logs a warning each time
            key = f"ddpkit/ask/{number}"
            try:
                if not store.check([key]):
                    if int(store.add(_ASKS, 0)) > number:  # drawn, but not written: a stranger's gap, or slow
                        missing_since = missing_since or time.monotonic()
                        if time.monotonic() - missing_since > _GAP_S:
                            number, missing_since = number + 1, None
                    continue
                nonce = bytes(store.get(key))[:64]
                keys.put(f"ddpkit/answer/{number}", nonce + b"|" + self.job.encode())
            except Exception as exc:  # the store is gone: closed
                log.debug("the job record's server stops answering: %s", exc)
                return
            number, missing_since = number + 1, None

    def close(self) -> None:
        """Stop serving the record (the job is over)."""
        self._stop.set()
        self._thread.join(timeout=2.0)
        release_store(self.port)


class JobRecord:
    """A replica group's connection to the job's record (:class:`RecordServer`) at ``host:port``: it learns the
    job's id from the server, then reads and writes the record signed for it.

    Raises:
        RecordUnreachableError: nothing answers at ``host:port``, or not with the job's record in ``timeout``
            seconds (its message names the address).
        DDPKitError: the record holds another job secret than this process, or none where this process has one.
    """

    def __init__(self, host: str, port: int, secret: bytes | None, timeout: float) -> None:
        self.address = f"{bracketed(host)}:{port}"
        self._secret, self._timeout = secret, timeout
        try:
            with socket.create_connection((host, port), timeout=min(timeout, 5.0)):
                pass
            self._store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as exc:
            raise RecordUnreachableError(
                f"the job's record at {self.address}, beside the lighthouse, does not answer ({_first_line(exc)}): "
                "the lighthouse is gone, or it was not served by ddpkit (`ddpkit lighthouse`, `ddpkit run "
                "--fault-tolerance`, or ddpkit.fault_tolerance.serve_lighthouse serve the record on the "
                "lighthouse's port + 1)"
            ) from None
        #: The job's id, as the record's server drew it.
        self.job = self._ask_for_the_job()
        self._keys = SealedKeys(self._store, secret, f"ddpkit job record v1|{self.job}")
        self._pending: tuple[int, int, tuple[str, ...]] | None = None
        self._wake = threading.Condition()
        self._writer: threading.Thread | None = None
        self._closed = False
        self._beats: dict[str, tuple[int, float]] = {}  # key -> (the count seen, since when)
        self._watching: Any = None  # the watcher's own connection (the main thread's)

    def _ask_for_the_job(self) -> str:
        number = int(self._store.add(_ASKS, 1))
        nonce = secrets.token_hex(16).encode()
        self._store.set(f"ddpkit/ask/{number}", nonce)  # type: ignore[arg-type]
        keys = SealedKeys(self._store, self._secret, _HANDSHAKE)
        key, deadline = f"ddpkit/answer/{number}", time.monotonic() + self._timeout
        raw = b""
        while time.monotonic() < deadline:
            if self._store.check([key]):
                raw = bytes(self._store.get(key))
                value = keys.open(key, raw)
                if value is not None and value.startswith(nonce + b"|"):
                    return value[len(nonce) + 1 :].decode()
                if self._secret is not None and raw.startswith(nonce + b"|"):
                    raise UnsignedRecordError(
                        f"the job's record at {self.address} (beside the lighthouse) answers without the job secret: "
                        f"the lighthouse's process was not given the job's ({secret_source()})"
                    )
            time.sleep(_POLL_S)  # not there yet, or a stranger's (or an earlier one): the server's comes
        if self._secret is None and raw and not raw.startswith(nonce + b"|"):
            why = "it answers with a job secret, and this process has none: give it the job's (DDPKIT_JOB_SECRET)"
        elif raw:
            why = "its answer is not signed with this process's job secret: the lighthouse runs with another one"
        else:
            why = f"no answer within {self._timeout:g} s"
        raise DDPKitError(f"the job's record at {self.address} (beside the lighthouse): {why}; see {GUIDE}")

    def read(self) -> Record:
        """The record as it is now (an empty one before any step was committed).

        Raises:
            RecordUnreachableError: the record's store is gone (with the lighthouse).
        """
        return self._read()[0]

    def _read(self) -> tuple[Record, bytes]:
        try:
            if not self._store.check([_KEY]):
                return Record(), b""
            raw = bytes(self._store.get(_KEY))
        except Exception as exc:
            raise RecordUnreachableError(f"the job's record at {self.address} is gone ({_first_line(exc)})") from None
        value = self._keys.open(_KEY, raw)
        if value is None:  # a stranger's, or another job's: not the job's
            return Record(), raw
        return Record.from_bytes(value), raw

    def update(self, change: Callable[[Record], Record | None]) -> Record:
        """Replace the record with ``change(record)`` unless that is ``None``, atomically (compare-and-set, tried
        again when another process wrote in between); the record afterwards.

        Raises:
            RecordUnreachableError: the record's store is gone (with the lighthouse).
        """
        while True:
            record, raw = self._read()
            new = change(record)
            if new is None or new == record:
                return record
            mine = self._keys.seal(_KEY, new.to_bytes())
            try:
                now = bytes(self._store.compare_set(_KEY, raw, mine))  # type: ignore[arg-type]
            except Exception as exc:
                gone = f"the job's record at {self.address} is gone ({_first_line(exc)})"
                raise RecordUnreachableError(gone) from None
            if now == mine:
                return new

    def note_commit(self, generation: int, step: int, holders: tuple[str, ...]) -> None:
        """Record, in the background, that the quorum of ``holders`` committed ``step`` (of the job's
        ``generation``): written unless the record holds a later step already (the newest note wins, at most every
        :data:`_NOTE_EVERY_S` seconds; a note never waits for the store)."""
        with self._wake:
            self._pending = (generation, step, holders)
            self._wake.notify()
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_notes, name="ddpkit-job-record-writer", daemon=True)
            self._writer.start()

    def _write_notes(self) -> None:
        def later(note: tuple[int, int, tuple[str, ...]]) -> Callable[[Record], Record | None]:
            generation, step, holders = note

            def change(record: Record) -> Record | None:
                if (generation, step) <= (record.generation, record.step) or record.failed or record.finished:
                    return None
                return replace(record, generation=generation, step=step, holders=holders)

            return change

        while True:
            with self._wake:
                while self._pending is None and not self._closed:
                    self._wake.wait()
                if self._pending is None:
                    return
                note, self._pending = self._pending, None
            try:
                self.update(later(note))
            except Exception as exc:  # the lighthouse is gone: the job ends with it
                log.debug("the job's record could not be written: %s", exc)
            time.sleep(_NOTE_EVERY_S)  # one write for the steps committed meanwhile

    def start_beating(self, process: str, rank: int) -> None:
        """Beat for rank ``rank`` of ``process`` (torchft's ``NAME:uuid``) in the background, every :data:`BEAT_S`
        seconds, until :meth:`close`: a stopped or dead process stops beating (see :meth:`stalled`)."""
        store = self._store.clone()  # type: ignore[attr-defined]
        key = f"ddpkit/beat/{process}/{rank}"

        def beat() -> None:
            while not self._closed:
                try:
                    store.add(key, 1)
                except Exception as exc:  # the lighthouse is gone: the job ends with it
                    log.debug("the job's record took no beat: %s", exc)
                    return
                time.sleep(BEAT_S)

        threading.Thread(target=beat, name="ddpkit-job-record-beat", daemon=True).start()

    def stalled(self, processes: list[str], rank: int) -> list[str]:
        """The processes among ``processes`` whose rank ``rank`` has not beaten for :data:`STALLED_S` seconds, as
        this process saw their beats (from the first time it asked: call it repeatedly while waiting). An unsigned
        count: a stranger can only make a stalled process look alive (then the step waits its timeout)."""
        if self._watching is None:
            self._watching = self._store.clone()  # type: ignore[attr-defined]
        now, found = time.monotonic(), []
        for process in processes:
            key = f"ddpkit/beat/{process}/{rank}"
            count = int(self._watching.add(key, 0))
            seen = self._beats.get(key)
            if seen is None or seen[0] != count:
                self._beats[key] = (count, now)
            elif now - seen[1] > STALLED_S:
                found.append(process)
        return found

    def close(self) -> None:
        """Write what is noted, stop beating, then stop."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._writer is not None:
            self._writer.join(timeout=5.0)


class LocalRecord:
    """What a replica group keeps of the job's record in its own process, where the lighthouse's record cannot be
    trusted (:class:`UnsignedRecordError`): the quorums it judges, the step it noted, nothing another process
    wrote. Two groups started again together then cannot know that a third holds a later state, and no beat
    tells a stopped member: the protections of the job's record are off, as before there was one."""

    def __init__(self) -> None:
        self._record = Record()

    def read(self) -> Record:
        return self._record

    def update(self, change: Callable[[Record], Record | None]) -> Record:
        new = change(self._record)
        if new is not None:
            self._record = new
        return self._record

    def note_commit(self, generation: int, step: int, holders: tuple[str, ...]) -> None:
        self.update(lambda now: replace(now, generation=generation, step=step, holders=holders)
                    if (generation, step) > (now.generation, now.step) and not now.finished else None)  # fmt: skip

    def start_beating(self, process: str, rank: int) -> None:
        """Nothing: nobody else reads this record."""

    def stalled(self, processes: list[str], rank: int) -> list[str]:
        """None: no beats reach this process."""
        return []

    def close(self) -> None:
        """Nothing to write."""


def _first_line(error: BaseException) -> str:
    return str(error).strip().partition("\n")[0][:200] or type(error).__name__
