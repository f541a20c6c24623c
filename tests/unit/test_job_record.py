"""A fault-tolerant job's record beside its lighthouse, and the verdict each replica group gives a quorum by it:
no quorum behind the job trains, a job whose state is lost says so instead of starting over, a job that finished
stays finished.

The tests that start processes (the chaos suite) are in tests/e2e/test_chaos.py.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ddpkit.errors import DDPKitError
from tests.helpers import JOB_SECRET, OTHER_SECRET
from tests.support.fault_tolerance import _digits_loop

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

from ddpkit.fault_tolerance import TorchFT, serve_lighthouse  # noqa: E402
from ddpkit.fault_tolerance._quorums import JobEnded, QuorumJudge, Verdict  # noqa: E402
from ddpkit.fault_tolerance._record import (  # noqa: E402
    JobRecord,
    Record,
    RecordUnreachableError,
    UnsignedRecordError,
    record_address,
)

SECRET = JOB_SECRET.encode()


def _connect(lighthouse: Any, secret: bytes | None = SECRET) -> JobRecord:
    return JobRecord(*record_address(lighthouse.address), secret, timeout=10.0)


def test_the_record_listens_beside_the_lighthouse_and_each_lighthouse_is_a_job_of_its_own() -> None:
    with serve_lighthouse("127.0.0.1", secret=SECRET) as first, serve_lighthouse("127.0.0.1", secret=SECRET) as other:
        port = int(first.address.rpartition(":")[2])
        assert first.record == f"127.0.0.1:{port + 1}"
        one, two = _connect(first), _connect(other)
        assert one.job != two.job, "each lighthouse draws its job's id"
        one.update(lambda now: replace(now, step=7, holders=("g0:a",)))
        assert one.read() == Record(step=7, holders=("g0:a",))
        assert _connect(first).read().step == 7, "another process of the job reads the same record"
        assert two.read() == Record(), "another job's record is its own"
        one.close()
        two.close()


def test_a_record_of_another_job_with_the_same_secret_or_a_strangers_value_is_not_the_jobs() -> None:
    """Copied from another job (the same secret, another id) or written by a program without the secret: read as
    no record at all (a disruption, never a forged step or a forged end)."""
    with serve_lighthouse("127.0.0.1", secret=SECRET) as first, serve_lighthouse("127.0.0.1", secret=SECRET) as other:
        mine, theirs = _connect(first), _connect(other)
        theirs.update(lambda now: replace(now, step=9, finished=(9, "g0")))
        raw = bytes(theirs._store.get("ddpkit/job"))
        mine._store.set("ddpkit/job", raw)  # a replay of the other job's signed record
        assert mine.read() == Record()
        mine._store.set("ddpkit/job", Record(step=50, finished=(50, "x")).to_bytes())  # a stranger's, unsigned
        assert mine.read() == Record()
        assert mine.update(lambda now: replace(now, step=3)).step == 3, "the job's own write takes the key back"
        assert mine.read().step == 3
        mine.close()
        theirs.close()


def test_a_replayed_answer_to_the_question_for_the_jobs_id_is_not_taken() -> None:
    """Each process asks for the job's id with a fresh nonce: an answer signed for another nonce (recorded from an
    earlier question, or another job's) is not taken, and the server's own answer is."""
    from ddpkit._trust.sealed import SealedKeys
    from ddpkit.fault_tolerance import _record

    with serve_lighthouse("127.0.0.1", secret=SECRET) as lighthouse:
        first = _connect(lighthouse)
        old = bytes(first._store.get("ddpkit/answer/1"))
        host, port = record_address(lighthouse.address)
        store = torch.distributed.TCPStore(host, port, is_master=False)
        keys = SealedKeys(store, SECRET, _record._HANDSHAKE)
        keys.put("ddpkit/answer/2", b"0" * 32 + b"|" + b"f" * 32)  # written ahead for the next asker: wrong nonce
        assert keys.open("ddpkit/answer/2", bytes(store.get("ddpkit/answer/2"))) is not None
        second = _connect(lighthouse)
        assert second.job == first.job != "f" * 32
        assert old != bytes(store.get("ddpkit/answer/2")), "the server answered the second question itself"
        first.close()
        second.close()


def test_a_record_with_another_secret_or_none_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit._trust.secret import SECRET_VARIABLE

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    with serve_lighthouse("127.0.0.1", secret=SECRET) as signed:
        with pytest.raises(DDPKitError, match="answers with a job secret, and this process has none"):
            JobRecord(*record_address(signed.address), None, timeout=1.0)
        with pytest.raises(DDPKitError, match="not signed with this process's job secret"):
            JobRecord(*record_address(signed.address), OTHER_SECRET.encode(), timeout=1.0)
    with serve_lighthouse("127.0.0.1") as plain, pytest.raises(UnsignedRecordError, match="answers without the job "):
        JobRecord(*record_address(plain.address), SECRET, timeout=10.0)  # no secret where the lighthouse runs: at once
    with pytest.raises(
        RecordUnreachableError, match=r"does not answer .*serve the record on the lighthouse's port \+ 1"
    ):
        JobRecord("127.0.0.1", _free_port(), SECRET, timeout=1.0)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_lighthouse_whose_next_port_is_taken_says_so_and_a_free_one_finds_a_pair() -> None:
    import socket

    from ddpkit.errors import PortTakenError

    with socket.socket() as other:  # a program of its own on the port after the lighthouse's
        for _ in range(20):
            port = _free_port()
            try:
                other.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                continue
        other.listen()
        with pytest.raises(PortTakenError, match=rf"port {port + 1} of 127\.0\.0\.1 is taken, and the job's record"):
            serve_lighthouse("127.0.0.1", port, secret=SECRET)
    with serve_lighthouse("127.0.0.1", secret=SECRET) as lighthouse:  # port 0: any free pair
        assert int(lighthouse.record.rpartition(":")[2]) == int(lighthouse.address.rpartition(":")[2]) + 1


def test_commits_are_noted_in_the_background_the_newest_wins_and_an_older_never_replaces_it() -> None:
    with serve_lighthouse("127.0.0.1", secret=SECRET) as lighthouse:
        writer, reader = _connect(lighthouse), _connect(lighthouse)
        for step in range(1, 40):
            writer.note_commit(0, step, ("g0:a", "g1:b"))
        writer.close()  # writes what is noted, then stops
        assert reader.read() == Record(step=39, holders=("g0:a", "g1:b"))
        late = _connect(lighthouse)
        late.note_commit(0, 12, ("g2:c",))  # a note of a group that fell behind
        late.close()
        assert reader.read().step == 39
        went_back = _connect(lighthouse)
        went_back.note_commit(1, 12, ("g2:c",))  # a later generation: the job went back to step 12
        went_back.close()
        assert reader.read() == Record(generation=1, step=12, holders=("g2:c",))
        reader.close()


class _Record:
    """A job's record in memory, for the judge."""

    def __init__(self, record: Record) -> None:
        self.record = record

    def read(self) -> Record:
        return self.record

    def update(self, change: Any) -> Record:
        new = change(self.record)
        if new is not None:
            self.record = new
        return self.record


def _quorum(quorum_id: int, step: int, *ids: str) -> Any:
    return SimpleNamespace(quorum_id=quorum_id, max_step=step, replica_ids=list(ids))


def _judge(record: Record, **kwargs: Any) -> tuple[QuorumJudge, _Record]:
    memory = _Record(record)
    settings = {"start": 0, "replica_groups": 3, "quorum_timeout": 0.3, **kwargs}
    return QuorumJudge(memory, "g1", **settings), memory  # type: ignore[arg-type]


def test_a_quorum_that_holds_the_jobs_state_trains_and_the_same_quorum_is_not_read_again() -> None:
    judge, memory = _judge(Record(step=40, holders=("g0:a", "g1:b", "g2:c")))
    assert judge(_quorum(5, 40, "g0:a", "g1:b", "g2:c")) == Verdict("accept")
    assert judge(_quorum(6, 41, "g1:b", "g1:x")) == Verdict("accept"), "ahead of the record (it lags a commit)"
    memory.record = Record(failed="read only for a new quorum")
    assert judge(_quorum(6, 42, "g1:b", "g1:x")) == Verdict("accept"), "no other quorum formed since"


def test_a_quorum_of_groups_started_again_waits_for_a_holder_of_the_jobs_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two groups killed together and started again (steps 0 and a checkpoint's 31), the third still alive but not
    in their quorum: they ask again, saying once why, until it joins them (then they take its state)."""
    judge, _ = _judge(Record(step=57, holders=("g0:a", "g1:b", "g2:c")))
    with caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
        assert judge(_quorum(9, 31, "g1:new", "g2:new")) == Verdict("again")
        assert judge(_quorum(10, 31, "g1:new", "g2:new")) == Verdict("again")
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "replica group g1: the quorum (g1, g2, at step 30) is behind the job (step 56, held by g0): it waits for a "
        "group that holds the job's state"
    ]
    assert judge(_quorum(11, 57, "g0:a", "g1:new", "g2:new")) == Verdict("accept")


def test_when_every_holder_is_gone_the_job_goes_on_from_its_newest_checkpoint_and_says_which_steps_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    judge, memory = _judge(Record(generation=2, step=57, holders=("g0:a", "g1:b")))
    with caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
        assert judge(_quorum(9, 31, "g0:new", "g1:new", "g2:c")) == Verdict("accept")
    assert memory.record == Record(generation=3, step=31, holders=("g0:new", "g1:new", "g2:c"))
    assert judge.generation == 3, "its commits are noted in the new generation"
    assert "goes on from step 30, the newest state its groups hold (a checkpoint's), and trains steps 31-56" in (
        caplog.text
    )


def test_a_holder_that_never_comes_back_is_waited_for_quorum_timeout_then_given_up() -> None:
    judge, memory = _judge(Record(step=57, holders=("g0:a", "g1:b")))
    assert judge(_quorum(9, 31, "g1:new")) == Verdict("again"), "g0:a may be alive (stalled, or in a long step)"
    time.sleep(0.35)
    assert judge(_quorum(10, 31, "g1:new")) == Verdict("accept")
    assert memory.record.step == 31


def test_with_nothing_left_that_holds_any_of_its_state_the_job_ends_with_the_reason_instead_of_starting_over() -> None:
    judge, memory = _judge(Record(step=12, holders=("g0:a", "g1:b")))
    verdict = judge(_quorum(4, 0, "g0:new", "g1:new"))
    assert (verdict.kind, verdict.status) == ("end", 1)
    assert re.fullmatch(
        r"the job cannot go on: it had committed 11 steps, the replica groups that held its state are gone \(g0, "
        r"g1\), and no group holds a checkpoint of it \(TrainLoop's checkpoint_dir\): start the job again",
        verdict.why,
    ), verdict.why
    assert memory.record.failed is not None, "every later start ends at once"
    assert QuorumJudge.ended(memory.record, 0) == (1, verdict.why)


def test_a_finished_job_ends_a_group_behind_it_and_lets_one_that_holds_its_last_state_train_it_further() -> None:
    finished = Record(step=70, holders=("g0:a",), finished=(70, "g0"))
    judge, memory = _judge(finished)
    assert judge(_quorum(3, 0, "g1:new")) == Verdict(
        "end", 0, "the job finished at step 69 (replica group g0 trained its last step)"
    )
    assert QuorumJudge.ended(finished, 70) is None, "resumed from the last checkpoint: the same job, further"
    assert judge(_quorum(4, 70, "g1:new")) == Verdict("accept")
    assert memory.record.finished is None


def test_the_jobs_first_quorum_waits_for_its_groups_then_starts_with_those_that_came(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once one group's wait is over, the record says the job started: its other groups stop waiting (their own
    waits began later), and none waits again when a later quorum lacks a group."""
    judge, memory = _judge(Record())
    assert judge(_quorum(1, 0, "g0:a", "g1:b")) == Verdict("again")
    assert judge(_quorum(2, 0, "g0:a", "g1:b", "g2:c")) == Verdict("accept")
    assert memory.record.started
    late, memory = _judge(Record())
    assert late(_quorum(1, 0, "g1:b", "g2:c")) == Verdict("again")
    time.sleep(0.35)
    with caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
        assert late(_quorum(2, 0, "g1:b", "g2:c")) == Verdict("accept")
    assert "the job starts with 2 of its 3 replica groups (g1, g2)" in caplog.text
    other = QuorumJudge(memory, "g2", start=0, replica_groups=3, quorum_timeout=30.0)  # type: ignore[arg-type]
    assert other(_quorum(2, 0, "g1:b", "g2:c")) == Verdict("accept"), "g1 began: g2 waits no more"
    assert late(_quorum(3, 1, "g1:b")) == Verdict("accept")
    ahead, _ = _judge(Record(), start=0)
    assert ahead(_quorum(1, 31, "g0:a")) == Verdict("accept"), "a group holds a checkpoint: the others take it"


def test_a_restarted_group_with_no_checkpoint_whose_jobs_holders_are_gone_ends_with_status_1_and_no_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart (its agent's TORCHELASTIC_RESTART_COUNT above 0) of one of a job's groups, whose record says that
    the job committed 5 steps, held by a process of this group that is gone: it cannot take the state from
    anyone, and has no checkpoint, so it says the job must start again and ends without a restart by its agent
    (it once trained the whole run alone from step 0). With a checkpoint, it goes on from there."""
    from ddpkit._failures import StopWithoutRestart
    from ddpkit._trust.secret import SECRET_VARIABLE

    monkeypatch.setenv(SECRET_VARIABLE, JOB_SECRET)
    monkeypatch.setenv("DDPKIT_REPLICA_GROUPS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    settings = {"timeout": 10, "quorum_timeout": 1.0}
    with serve_lighthouse("127.0.0.1") as lighthouse:
        _connect(lighthouse).update(lambda now: replace(now, step=6, holders=("g1:dead",)))
        loop = _digits_loop(fault_tolerance=TorchFT(lighthouse.address, "g1", **settings), global_batch_size=64,
                            checkpoint_dir=tmp_path)  # fmt: skip
        with pytest.raises(StopWithoutRestart) as ended:
            loop.fit(1)
        assert _connect(lighthouse).read().failed is not None
    assert ended.value.code == 1
    assert (loop.global_step, list(tmp_path.iterdir())) == (0, [])
    said = r"ddpkit: replica group g1: the job cannot go on: it had committed 5 steps, the replica groups that held its"
    assert re.search(said + r" state are gone \(g1\), .* start the job again", capsys.readouterr().err)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _digits_loop(checkpoint_dir=tmp_path, checkpoint_every=3, global_batch_size=64, samples=256).fit(1)  # 4 steps
    with serve_lighthouse("127.0.0.1") as lighthouse:
        _connect(lighthouse).update(lambda now: replace(now, step=9, holders=("g1:dead",)))
        loop = _digits_loop(fault_tolerance=TorchFT(lighthouse.address, "g1", **settings), global_batch_size=64,
                            checkpoint_dir=tmp_path, samples=256)  # fmt: skip
        loop.fit(2)
        assert _connect(lighthouse).read().generation == 1, "it went back to the checkpoint's step"
    assert loop.global_step == 8


def test_a_group_started_again_that_reaches_no_lighthouse_trains_nothing_and_ends_with_status_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpkit._trust.secret import SECRET_VARIABLE

    monkeypatch.setenv(SECRET_VARIABLE, JOB_SECRET)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    loop = _digits_loop(fault_tolerance=TorchFT(f"http://127.0.0.1:{_free_port()}", "g1", timeout=2),
                        global_batch_size=64)  # fmt: skip
    with pytest.raises(SystemExit) as ended:
        loop.fit(1)
    assert ended.value.code == 0
    assert "ddpkit: replica group g1: started again, it reaches no lighthouse that answers" in capsys.readouterr().err
    with pytest.raises(JobEnded):
        raise JobEnded(0, "a JobEnded is a DDPKitError")


def test_a_group_with_the_secret_and_a_lighthouse_without_it_trains_without_the_record_saying_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A lighthouse started without the job secret (as `ddpkit lighthouse` without --secret-file was, before it had
    a record) and a group given one: the group cannot trust the record, says so once with the fix, and trains as
    before the record existed."""
    from ddpkit._trust.secret import SECRET_VARIABLE

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    with serve_lighthouse("127.0.0.1") as lighthouse:
        monkeypatch.setenv(SECRET_VARIABLE, JOB_SECRET)
        loop = _digits_loop(fault_tolerance=TorchFT(lighthouse.address, "g0", timeout=10), global_batch_size=64,
                            samples=256)  # fmt: skip
        with caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
            loop.fit(1)
        assert _connect(lighthouse, None).read() == Record(), "nothing was written in the untrusted record"
    assert loop.global_step == 4
    assert "answers without the job secret: the lighthouse's process was not given the job's" in caplog.text
    assert "ddpkit lighthouse --secret-file" in caplog.text


def test_a_quorum_of_replica_groups_of_different_sizes_ends_the_job_naming_each_groups_ranks() -> None:
    """Rank r of each group averages its gradients (a sharded model's shards) with rank r of the others: groups of
    2 and 3 ranks cannot train together. The judge ends the job at once (status 1) naming them, and the record
    says so for any group that joins later; groups of one size, and a record with no sizes (an older group's),
    train."""
    record = Record(ranks=(("g0", 2), ("g1", 3), ("g2", 2)))
    judge, memory = _judge(record)
    verdict = judge(_quorum(1, 0, "g0:a", "g1:b"))
    assert verdict.kind == "end"
    assert verdict == Verdict(
        "end", 1, "the job cannot go on: its replica groups have different numbers of ranks (g0 has 2 ranks, g1 has 3 "
        "ranks): rank r of each group averages its gradients with rank r of the others, so every group needs the "
        "same number (start every group with the same --group-size, or the same number of processes on every node)"
    )  # fmt: skip
    assert memory.record.failed is not None
    assert memory.record.failed in verdict.why
    assert _judge(record, replica_groups=2)[0](_quorum(1, 0, "g0:a", "g2:c")) == Verdict("accept")
    assert _judge(Record(), replica_groups=2)[0](_quorum(1, 0, "g0:a", "g1:b")) == Verdict("accept")


def test_a_groups_ranks_are_written_once_and_read_back_from_the_records_bytes() -> None:
    record = Record().with_ranks("g0", 2)
    assert record is not None
    assert record.with_ranks("g0", 2) is None, "unchanged: nothing to write"
    again = record.with_ranks("g0", 4)
    assert again is not None
    assert again.ranks == (("g0", 4),), "a group started again with another size replaces its entry"
    assert Record.from_bytes(again.with_ranks("g1", 4).to_bytes()).ranks == (("g0", 4), ("g1", 4))  # type: ignore[union-attr]
