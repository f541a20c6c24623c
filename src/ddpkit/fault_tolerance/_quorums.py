"""Which quorums may train: a replica group judges each new quorum that torchft's lighthouse forms against the
job's record (:mod:`ddpkit.fault_tolerance._record`) before torchft sets it up, and asks for another quorum
instead of one that must not train.

A quorum trains when it holds the job's state: its highest step (torchft's ``max_step``) is at least the
record's. One that is behind (its groups were all started again, or fell behind in a stall, while a group that
holds the state is still alive somewhere) does not: its groups ask again until a holder joins them, and take the
state from it in that quorum. Only when no holder can be left (each holder's group is back in the quorum as a
new process, or none came within ``quorum_timeout``) does the quorum go on from the newest state it has (a
checkpoint's: the record says the job went back), and when it has none at all the job cannot go on: the record
says so and every group ends with a non-zero status, never starting over from step 0 silently. Before the job's
first commit, its first quorum waits for the job's ``replica_groups``. A quorum after the job finished ends
the group (status 0).

The quorum a group's rank 0 judges is the one its other ranks received too (torchft's manager server asks the
lighthouse once for all of them); they take rank 0's verdict from the group's store (:class:`VerdictRelay`), so
that the group's ranks always ask again, or go on, together.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Literal

from ddpkit._trust.sealed import SealedKeys
from ddpkit.errors import DDPKitError
from ddpkit.fault_tolerance._record import JobRecord, LocalRecord, Record

__all__ = ["JobEnded", "QuorumJudge", "QuorumVerdicts", "Verdict", "VerdictRelay", "group_name"]

log = logging.getLogger(__name__)


def group_name(replica_id: str) -> str:
    """A quorum member's replica id without the ``:uuid`` that torchft appends for each process."""
    return replica_id.rpartition(":")[0] or replica_id


class JobEnded(DDPKitError):  # noqa: N818  # not an error when the job finished
    """The job has nothing left for this replica group: it finished (``status`` 0), or it cannot go on (every group
    that held its state is gone and nothing holds a newer one than step 0: ``status`` 1). ``why`` says which."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status, self.why = status, why


@dataclass(frozen=True)
class Verdict:
    """What to do with a quorum: ``accept`` it, ask ``again``, or ``end`` the group (``status``, ``why``)."""

    kind: Literal["accept", "again", "end"]
    status: int = 0
    why: str = ""

    def encode(self) -> bytes:
        return f"{self.kind}|{self.status}|{self.why}".encode()

    @classmethod
    def decode(cls, data: bytes) -> Verdict:
        kind, status, why = data.decode().split("|", 2)
        assert kind in ("accept", "again", "end"), kind
        return cls(kind, int(status), why)  # type: ignore[arg-type]


ACCEPT, AGAIN = Verdict("accept"), Verdict("again")


class QuorumJudge:
    """Rank 0 of a replica group: the verdict on each quorum torchft's lighthouse gives it (the module's rules).

    Args:
        record: the job's record.
        replica_id: this group's name (for the log).
        start: this group's step when it started (torchft's count: a checkpoint's, or 0).
        replica_groups: how many groups the job starts (its first quorum waits for them), or ``None``.
        quorum_timeout: seconds to wait for the job's groups at its start, or for a holder of its state.
    """

    def __init__(self, record: JobRecord | LocalRecord, replica_id: str, *, start: int, replica_groups: int | None,
                 quorum_timeout: float) -> None:  # fmt: skip
        self.record, self.replica_id, self.start = record, replica_id, start
        self.replica_groups, self.quorum_timeout = replica_groups, quorum_timeout
        #: The generation of the job's record this group trains in (its commits are noted with it).
        self.generation = 0
        self._accepted: int | None = None  # the id of the last quorum accepted
        self._since: float | None = None  # when the present wait (for the job's groups, or a holder) began
        self._said = ""

    def __call__(self, quorum: Any) -> Verdict:
        """The verdict on ``quorum`` (torchft's ``QuorumResult``: ``quorum_id``, ``max_step``, ``replica_ids``).

        Raises:
            RecordUnreachableError: the job's record is gone (with the lighthouse).
        """
        if quorum.quorum_id == self._accepted:  # no other quorum formed since this group's last one
            return ACCEPT
        record = self.record.read()
        verdict = self._judge(record, int(quorum.max_step), list(quorum.replica_ids))
        if verdict.kind == "again":
            self._since = self._since if self._since is not None else time.monotonic()
        else:
            self._since, self._said = None, ""
        if verdict.kind == "accept":
            self._accepted = int(quorum.quorum_id)
        return verdict

    def _waited(self) -> bool:
        return self._since is not None and time.monotonic() - self._since > self.quorum_timeout

    @staticmethod
    def ended(record: Record, step: int) -> tuple[int, str] | None:
        """``(status, why)`` when ``record`` says the job has nothing left for a group whose state is at ``step``:
        it cannot go on (1), or it finished at a later step (0: a group that holds the finished job's state, as
        one resumed from its last checkpoint, may train it further); else ``None``."""
        if record.failed is not None:
            return 1, f"the job cannot go on: {record.failed}"
        if record.finished is not None and step < record.finished[0]:
            at, by = record.finished
            return 0, f"the job finished at step {committed(at)} (replica group {by} trained its last step)"
        return None

    def _judge(self, record: Record, step: int, ids: list[str]) -> Verdict:
        ended = self.ended(record, step)
        if ended is not None:
            return Verdict("end", *ended)
        uneven = _uneven(record, ids)
        if uneven is not None:
            self.record.update(lambda now: None if now.failed or now.finished else replace(now, failed=uneven))
            return Verdict("end", 1, f"the job cannot go on: {uneven}")
        if record.finished is not None:  # the quorum holds the finished job's state: it trains it further
            finished = record.finished
            self.record.update(lambda now: replace(now, finished=None) if now.finished == finished else None)
        self.generation = record.generation
        if record.step == 0 and not record.started:  # nothing committed yet: the job's start
            return self._start(step, ids)
        if step >= record.step:
            return ACCEPT
        live = [h for h in record.holders if not _replaced(h, ids)]
        if live and not self._waited():
            self._say(
                f"replica group {self.replica_id}: the quorum ({_names(ids)}, at step {committed(step)}) is behind the "
                f"job (step {committed(record.step)}, held by {_names(live)}): it waits for a group that holds the "
                "job's state"
            )
            return AGAIN
        gone = "did not come back within quorum_timeout" if live else "are gone"
        if step > 0:  # the newest state left: a checkpoint's, or a group that fell behind
            self.generation = record.generation + 1
            self.record.update(lambda now: _went_back(now, record, self.generation, step, tuple(ids)))
            log.warning(
                "replica group %s: the replica groups that held the job's state at step %d %s (%s); the job goes "
                "on from step %d, the newest state its groups hold (a checkpoint's), and trains steps %d-%d again",
                self.replica_id, committed(record.step), gone, _names(record.holders), committed(step),
                committed(step) + 1, committed(record.step),
            )  # fmt: skip
            return ACCEPT
        why = (
            f"it had committed {committed(record.step)} steps, the replica groups that held its state {gone} "
            f"({_names(record.holders)}), and no group holds a checkpoint of it (TrainLoop's checkpoint_dir): start "
            "the job again"
        )
        self.record.update(lambda now: None if now.failed or now.finished else replace(now, failed=why))
        return Verdict("end", 1, f"the job cannot go on: {why}")

    def _start(self, step: int, ids: list[str]) -> Verdict:
        """The job's first quorum waits until its ``replica_groups`` are in it (up to ``quorum_timeout``); then the
        record says that the job started, so that no group waits again, nor keeps waiting while another began."""
        groups = self.replica_groups
        if groups is not None and groups > 1 and len(ids) < groups and step == self.start:
            if not self._waited():
                return AGAIN
            log.warning(
                "replica group %s: the job starts with %d of its %d replica groups (%s): the others did not join "
                "within %g s (quorum_timeout)", self.replica_id, len(ids), groups, _names(ids), self.quorum_timeout,
            )  # fmt: skip
        self.record.update(lambda now: None if now.started else replace(now, started=True))
        return ACCEPT

    def _say(self, line: str) -> None:
        """Log ``line`` once per wait (at the first quorum that must wait)."""
        if not self._said:
            self._said = line
            log.warning("%s", line)


def _uneven(record: Record, ids: list[str]) -> str | None:
    """Why the quorum's groups cannot train together when the record gives them different numbers of ranks (rank
    ``r`` of each group averages its gradients, a sharded model's shards, with rank ``r`` of the others), else
    ``None``."""
    names = {group_name(i) for i in ids}
    sizes = {name: ranks for name, ranks in record.ranks if name in names}
    if len(set(sizes.values())) < 2:
        return None
    listed = ", ".join(f"{name} has {ranks} rank{'s' if ranks > 1 else ''}" for name, ranks in sorted(sizes.items()))
    return (
        f"its replica groups have different numbers of ranks ({listed}): rank r of each group averages its gradients "
        "with rank r of the others, so every group needs the same number (start every group with the same "
        "--group-size, or the same number of processes on every node)"
    )


def committed(step: int) -> int:
    """The training steps committed by a group at torchft's ``step`` (whose count includes the job's first quorum,
    which trains nothing)."""
    return max(step - 1, 0)


def _went_back(now: Record, seen: Record, generation: int, step: int, holders: tuple[str, ...]) -> Record | None:
    """The record once the job went back to ``step`` (held by ``holders``), unless it moved since it was read."""
    if (now.generation, now.step) != (seen.generation, seen.step) or now.failed or now.finished:
        return None
    return replace(now, generation=generation, step=step, holders=holders)


def _replaced(holder: str, ids: list[str]) -> bool:
    """Whether ``holder`` (``NAME:uuid``) is gone for sure: its group is in the quorum as another process."""
    name = group_name(holder)
    return any(group_name(member) == name and member != holder for member in ids)


def _names(ids: Any) -> str:
    return ", ".join(sorted({group_name(i) for i in ids})) or "none"


class QuorumVerdicts:
    """This rank's verdict on each quorum it receives: rank 0's judge's (published to the group's other ranks
    when it has several), or, on the other ranks, rank 0's as published.

    Raises (when called):
        RecordUnreachableError: the job's record is gone (on rank 0; the others get an ``end`` verdict).
        RuntimeError: rank 0 gave no verdict in time (on the other ranks).
    """

    def __init__(self, judge: QuorumJudge | None, relay: VerdictRelay | None) -> None:
        assert judge is not None or relay is not None, "rank 0 judges; the others need its verdicts"
        self._judge, self._relay = judge, relay
        self._received = 0

    def __call__(self, quorum: Any) -> Verdict:
        self._received += 1
        if self._judge is None:
            assert self._relay is not None
            return self._relay.receive(self._received)
        try:
            verdict = self._judge(quorum)
        except Exception as error:
            if self._relay is not None:
                self._relay.publish(self._received, Verdict("end", 1, f"rank 0 of this replica group: {error}"))
            raise
        if self._relay is not None:
            self._relay.publish(self._received, verdict)
        return verdict


class VerdictRelay:
    """Rank 0's verdicts to the other ranks of its replica group, through the group's store (signed for the group
    with the job secret): the ``n``-th quorum each rank received is the same quorum on every rank.

    Args:
        store: a connection of this rank's own to the group's store.
        secret: the job secret, or ``None``.
        context: what the group is (the same on its ranks, another for each start of the group).
        timeout: seconds the other ranks wait for rank 0's verdict.
    """

    def __init__(self, store: Any, secret: bytes | None, context: str, timeout: float) -> None:
        self._keys = SealedKeys(store, secret, f"ddpkit quorum verdicts|{context}")
        self._timeout = timeout

    def publish(self, number: int, verdict: Verdict) -> None:
        self._keys.put(f"ddpkit/verdict/{number}", verdict.encode())

    def receive(self, number: int) -> Verdict:
        """Rank 0's verdict on the ``number``-th quorum.

        Raises:
            RuntimeError: none came within the timeout (rank 0 is gone: the group's agent starts it again).
        """
        key, deadline = f"ddpkit/verdict/{number}", time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            value = self._keys.read(key)  # polled: a store's wait that times out logs a warning each time
            if value is not None:
                return Verdict.decode(value)
            time.sleep(0.005)
        raise RuntimeError(f"rank 0 of this replica group gave no verdict on its quorum within {self._timeout:g} s")
