"""Nobody else joins a fault-tolerant job: every quorum's members prove the job secret before anything moves
between them, a recovering group takes its state without pickle, and a job's groups share one secret.

Here, the tests that need no process; the others are in tests/e2e/test_quorum_proof.py.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import GroupProofError
from ddpkit.fault_tolerance._healing import EXTRA_BYTES, HealingRefusedError, TensorTransport
from tests.e2e.ft_stranger import Command
from tests.helpers import JOB_SECRET

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")


# --- the pickle-free healing transport ------------------------------------------------------------------------


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Wire:
    """A process group's ``send``/``recv`` between two ranks of one test: what rank 0 sends, rank 1 receives."""

    def __init__(self) -> None:
        self.messages: dict[int, bytes] = {}
        self.received_tags: list[int] = []

    def send(self, tensors: list[torch.Tensor], rank: int, tag: int) -> _Done:
        (tensor,) = tensors
        self.messages[tag] = bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        return _Done()

    def recv(self, tensors: list[torch.Tensor], rank: int, tag: int) -> _Done:
        (tensor,) = tensors
        data = self.messages[tag]
        target = tensor.reshape(-1).view(torch.uint8)
        assert target.numel() == len(data), f"tag {tag}: {len(data)} bytes sent into {target.numel()}"
        target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.received_tags.append(tag)
        return _Done()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "user": {"default": {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 2,
                             "history": {"loss": [1.5, 0.5]}, "rng": torch.get_rng_state(), "empty": torch.zeros(0)}},
        "torchft": {"step": 7, "batches_committed": 14},
    }  # fmt: skip


def _model_and_optimizer(seed: int, width: int = 4, step: bool = True) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))
    optimizer = torch.optim.Adam(model.parameters())
    if step:
        model(torch.randn(5, 3)).sum().backward()
        optimizer.step()
    return model, optimizer


def test_a_recovering_group_takes_tensors_and_plain_values_into_tensors_it_allocates() -> None:
    """The sender's state (weights, an Adam state the receiver does not have yet, numbers, lists, the random
    state, an empty tensor) arrives equal; the receiver's own tensors are left alone."""
    wire = _Wire()
    sender_model, sender_optimizer = _model_and_optimizer(0)
    sent = _state(sender_model, sender_optimizer)
    receiver_model, receiver_optimizer = _model_and_optimizer(1, step=False)
    before = {k: v.clone() for k, v in receiver_model.state_dict().items()}
    own = _state(receiver_model, receiver_optimizer)
    TensorTransport(wire, lambda: sent).send_checkpoint([1], 7, sent, timedelta(seconds=5))
    got = TensorTransport(wire, lambda: own).recv_checkpoint(0, "<process group>", 7, timedelta(seconds=5))

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return bool(a == b) and type(a) is type(b)

    assert same(sent, got)
    assert got["user"]["default"]["optimizer"]["state"][0]["exp_avg"].shape == (4, 3)
    assert all(torch.equal(before[k], v) for k, v in receiver_model.state_dict().items()), "received in place"
    receiver_optimizer.load_state_dict(got["user"]["default"]["optimizer"])  # what torchft then does


def test_a_state_of_another_model_is_refused_before_its_tensors_are_received() -> None:
    wire = _Wire()
    sender_model, sender_optimizer = _model_and_optimizer(0, width=5)
    sent = _state(sender_model, sender_optimizer)
    own = _state(*_model_and_optimizer(1, width=4, step=False))
    TensorTransport(wire, lambda: sent).send_checkpoint([1], 7, sent, timedelta(seconds=5))
    expected = (
        "state['user']['default']['model']['0.weight']: replica rank 0 offered a float32 tensor of shape (5, 3), "
        "this group's is float32 of shape (4, 3): the groups do not train the same model"
    )
    with pytest.raises(HealingRefusedError, match=re.escape(expected)):
        TensorTransport(wire, lambda: own).recv_checkpoint(0, "", 7, timedelta(seconds=5))
    assert wire.received_tags == [1, 2], "only the length and the header were received"


def test_a_state_of_another_step_is_refused() -> None:
    wire = _Wire()
    sent = _state(*_model_and_optimizer(0))
    TensorTransport(wire, lambda: sent).send_checkpoint([1], 7, sent, timedelta(seconds=5))
    with pytest.raises(HealingRefusedError, match="offered the state of step 7, not of step 8"):
        TensorTransport(wire, lambda: sent).recv_checkpoint(0, "", 8, timedelta(seconds=5))


def test_a_sender_cannot_make_a_recovering_group_allocate_what_it_likes() -> None:
    """New tensors (absent from the receiver's state) beyond four times its own bytes plus 64 MiB are refused
    from their shapes alone; so is a header length beyond that budget."""
    own = {"user": {"default": {"w": torch.zeros(10)}}, "torchft": {"step": 1, "batches_committed": 0}}
    wire = _Wire()
    huge = {"user": {"default": {"w": torch.zeros(10), "extra": torch.zeros(0)}}, "torchft": own["torchft"]}
    TensorTransport(wire, lambda: huge).send_checkpoint([1], 1, huge, timedelta(seconds=5))
    # What a lying sender would send: the header of a state whose "extra" is (2**40,) bytes.
    from ddpkit.collectives._codec import pack, unpack

    header = unpack(torch.frombuffer(bytearray(wire.messages[2]), dtype=torch.uint8))
    header["shapes"][1] = [2**40]
    forged = pack(header)
    wire.messages[2] = bytes(forged.numpy())
    wire.messages[1] = bytes(torch.tensor([forged.numel()], dtype=torch.int64).view(torch.uint8).numpy())
    beyond = r"state\['user'\]\['default'\]\['extra'\]: the tensors replica rank 0 offered that this group does not"
    with pytest.raises(HealingRefusedError, match=beyond + " have come to more than"):
        TensorTransport(wire, lambda: own).recv_checkpoint(0, "", 1, timedelta(seconds=5))
    wire.messages[1] = bytes(torch.tensor([EXTRA_BYTES + 10**6], dtype=torch.int64).view(torch.uint8).numpy())
    with pytest.raises(HealingRefusedError, match=r"has a header of 68108864 bytes; this group takes at most 67109024"):
        TensorTransport(wire, lambda: own).recv_checkpoint(0, "", 1, timedelta(seconds=5))


def test_a_pickled_state_from_torchfts_own_transport_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    """torchft's ``PGTransport`` pickles the state's structure (and any object in it): what ddpkit receives from
    it is refused as not its encoding, and the command inside never runs."""
    from torchft.checkpointing.pg_transport import PGTransport

    marker = tmp_path / "marker"
    wire = _Wire()
    sent = {"user": {"default": {"w": torch.ones(3), "command": Command(f"touch {marker}")}},
            "torchft": {"step": 3, "batches_committed": 0}}  # fmt: skip
    PGTransport(wire, timeout=timedelta(seconds=5), device=torch.device("cpu")).send_checkpoint(
        [1], 3, sent, timedelta(seconds=5)
    )
    own = {"user": {"default": {"w": torch.zeros(3)}}, "torchft": {"step": 0, "batches_committed": 0}}
    with pytest.raises(HealingRefusedError, match="is not ddpkit's pickle-free encoding of a state"):
        TensorTransport(wire, lambda: own).recv_checkpoint(0, "", 3, timedelta(seconds=5))
    assert not marker.exists(), "the pickled command ran"


def test_a_state_holding_an_object_is_not_sent() -> None:
    wire = _Wire()
    state = {"user": {"default": {"command": Command("true")}}, "torchft": {}}
    with pytest.raises(TypeError, match=r"obj\['state'\]\['user'\]\['default'\]\['command'\] is a "):
        TensorTransport(wire, lambda: state).send_checkpoint([1], 0, state, timedelta(seconds=5))
    assert wire.messages == {}


# --- the quorum's proof -------------------------------------------------------------------------------------


def _owned_store(owner: str, secret: bytes = b"job") -> TCPStore:
    """A replica group's store, as its rank 0 leaves it: torchft's manager wrote the group's id there, ddpkit the
    signed record that the store is that group's."""
    from ddpkit.fault_tolerance._quorum_proof import claim_store

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    claim_store(f"127.0.0.1:{store.port}", owner, secret)
    return store


def _configure_in_threads(secrets: list[bytes | None], ids: list[str]) -> tuple[list[Any], list[BaseException | None]]:
    """One quorum of ``len(secrets)`` members, each a thread configuring a group with its secret (``None``:
    torchft's own group, as a stranger's ``Manager`` has)."""
    from ddpkit.fault_tolerance._quorum_proof import proven_gloo

    store = _owned_store(ids[0])
    address = f"127.0.0.1:{store.port}/torchft/3/0"
    groups = [proven_gloo(secret, 3.0, lambda: ids) if secret is not None
              else torchft.ProcessGroupGloo(timeout=timedelta(seconds=3)) for secret in secrets]  # fmt: skip
    errors: list[BaseException | None] = [None] * len(secrets)

    def configure(rank: int) -> None:
        try:
            groups[rank].configure(address, ids[rank], rank, len(secrets), 3, 0, 1, list(range(len(secrets))))
        except BaseException as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=configure, args=(rank,)) for rank in range(len(secrets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return groups, errors


class _Recording(torch.distributed.Store):  # type: ignore[misc]
    """A store that keeps what is set in it (gloo writes each rank's address under ``0/RANK``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.written = torch.distributed.HashStore(), {}

    def set(self, key: str, value: Any) -> None:
        self.written[key] = bytes(value)
        self.inner.set(key, value)

    def get(self, key: str) -> Any:
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.inner.wait(keys, *([timeout] if timeout is not None else []))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))


def test_groups_that_bind_their_address_at_once_each_get_their_own_and_neither_waits_for_the_other() -> None:
    """Two replica groups of one process making their gloo groups at the same time, each on its address: while the
    first waits in gloo for its other member, the second makes its own on its address, and afterwards torchft's
    gloo groups are torch's plain ones again. (Once, the first held a lock there until gloo gave up, and a second
    could put the first's swapped class back for good: every later step of the process failed.)"""
    import time

    from ddpkit._trust.group_store import gloo_address
    from ddpkit.fault_tolerance._quorum_proof import _gloo_on

    module = torchft.process_group
    inside = threading.Event()
    stores = {"127.0.0.1": _Recording(), "::1": _Recording()}
    ended: dict[str, float] = {}

    def make(address: str) -> None:  # rank 0 of 2: gloo writes its address, then waits 1 s for rank 1
        with _gloo_on(module, address, 1.0):
            if address == "127.0.0.1":
                inside.set()
            with pytest.raises(RuntimeError, match=r"[Tt]imeout"):
                module.BaseProcessGroupGloo(stores[address], 0, 2, timedelta(seconds=1))
        ended[address] = time.monotonic()

    def second() -> None:
        assert inside.wait(10)
        make("::1")

    threads = [threading.Thread(target=make, args=("127.0.0.1",)), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert {address: gloo_address(store.written["0/0"]).rpartition(":")[0] for address, store in stores.items()} == {
        "127.0.0.1": "127.0.0.1", "::1": "[::1]"}  # fmt: skip
    assert ended["::1"] - ended["127.0.0.1"] < 0.8, "the second waited for the first to finish"
    plain = module.BaseProcessGroupGloo(torch.distributed.HashStore(), 0, 1, timedelta(seconds=5))
    assert isinstance(plain, torch.distributed.ProcessGroupGloo)


def test_a_quorums_members_that_hold_the_secret_prove_it_and_all_reduce() -> None:
    groups, errors = _configure_in_threads([b"job", b"job"], ["group-0:a1", "group-1:b2"])
    assert errors == [None, None]
    values = [torch.tensor([1.0]), torch.tensor([2.0])]
    works = [group.allreduce([value], torch._C._distributed_c10d.AllreduceOptions()) for group, value in zip(
        groups, values, strict=True)]  # fmt: skip
    for work in works:
        work.wait()
    assert [value.item() for value in values] == [3.0, 3.0]


def test_a_quorum_member_with_another_secret_is_named_and_the_group_is_never_made() -> None:
    """The addresses the members give each other in the quorum's store are signed: a member with another secret
    (or none: torchft's own group, as a stranger's ``Manager`` has) is refused as soon as the others read its
    address, named by its replica id and address, and no group is made."""
    for odd in (b"another", None):
        ids = ["group-0:a1", "group-1:b2", "group-x:c3"]
        groups, errors = _configure_in_threads([b"job", b"job", odd], ids)
        for rank in (0, 1):
            error = errors[rank]
            assert isinstance(error, GroupProofError), error
            said = (r"in the group's store (?:\(it points to [^)]*\) )?was not written by a process that holds the "
                    r"job secret" if odd is None else "did not reach the group's store in time")  # fmt: skip
            assert re.search(r"the address of rank 2 \(replica group 'group-x'[^)]*\) " + said, str(error)), error
            with pytest.raises(AssertionError, match="process group not initialized"):
                groups[rank].allreduce([torch.ones(1)], torch._C._distributed_c10d.AllreduceOptions())
        if odd is not None:  # it finds out at once, and writes nothing into the store
            assert isinstance(errors[2], GroupProofError), errors[2]
            refused = (r"the quorum's store at 127\.0\.0\.1:\d+, which torchft's lighthouse named, is not the store "
                       r"of a replica group of this quorum that holds the job secret .*: its record of its owner "
                       r"\('group-0:a1'\) is not signed with this group's secret")  # fmt: skip
            assert re.search(refused, str(errors[2])), errors[2]


def test_an_address_written_in_place_of_a_members_is_refused_before_the_group_connects_to_it() -> None:
    """What a stranger that wants to sit between two members must do first: write its own address under a
    member's key before that member does. The member reading it refuses it and names whose it claimed to be."""
    from ddpkit.fault_tolerance._quorum_proof import proven_gloo

    store = _owned_store("group-0:a1")
    store.set("torchft/5/0/0/1", b"the stranger's own gloo address")
    group = proven_gloo(b"job", 3.0, lambda: ["group-0:a1", "group-1:b2"])
    refused = (
        r"the address of rank 1 \(replica group 'group-1'\) in the group's store (?:\(it points to [^)]*\) )?"
        r"was not written"
    )
    with pytest.raises(GroupProofError, match=refused):
        group.configure(f"127.0.0.1:{store.port}/torchft/5/0", "group-0", 0, 2, 5, 0, 1, [0, 1])


def test_a_quorum_store_that_no_member_vouches_for_is_refused_before_anything_is_written_there() -> None:
    """torchft's lighthouse takes a group's store address from whoever speaks in its name: a store that is not a
    member's (none, or another process's, or a record copied from a member's store) is refused, naming it."""
    from ddpkit.fault_tolerance._quorum_proof import check_store_owner

    ids = ["group-0:a1", "group-1:b2"]
    ours = _owned_store("group-0:a1")
    check_store_owner(f"127.0.0.1:{ours.port}/torchft/3/0", ids, b"job", 10.0)  # a member's: taken
    strangers = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cases = [
        (strangers, "it says nothing of its owner"),
        (_owned_store("group-0:old"), r"it is the store of 'group-0:old', a process that is not in this quorum"),
    ]
    copied = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    copied.set("ddpkit/store-owner", ours.get("ddpkit/store-owner"))  # a member's record, in a stranger's store
    cases.append((copied, r"its record of its owner \('group-0:a1'\) is not signed with this group's secret for "
                          r"this address"))  # fmt: skip
    for store, why in cases:
        with pytest.raises(GroupProofError, match=rf"the quorum's store at 127\.0\.0\.1:{store.port}, which torchft's "
                           rf"lighthouse named, .*: {why}"):  # fmt: skip
            check_store_owner(f"127.0.0.1:{store.port}/torchft/3/0", ids, b"job", 10.0)
        assert sorted(store.list_keys()) in ([], ["ddpkit/store-owner"])


# --- one secret per job ---------------------------------------------------------------------------------------


class _Started:
    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.command, self.env = command, env

    def wait(self) -> int:
        return 0


def test_ddpkit_run_fault_tolerance_gives_every_group_one_secret_of_its_job_in_their_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpkit.fault_tolerance import _job

    started: list[_Started] = []
    monkeypatch.setattr(_job.subprocess, "Popen", lambda command, env: started.append(_Started(command, env)) or
                        started[-1])  # fmt: skip
    monkeypatch.delenv("DDPKIT_JOB_SECRET", raising=False)
    for _ in range(2):
        start = _job.script_groups("train.py", [], max_restarts=0)
        assert _job.run_replica_groups(start, groups=3, lighthouse="http://127.0.0.1:9") == [0, 0, 0]
    first, second = ({group.env["DDPKIT_JOB_SECRET"] for group in started[i : i + 3]} for i in (0, 3))
    assert len(first) == 1, "one secret per job"
    assert len(second) == 1, "one secret per job"
    assert first != second, "each job draws its own"
    assert re.fullmatch(r"[0-9a-f]{64}", next(iter(first))), "32 random bytes"
    assert not any(next(iter(first)) in " ".join(group.command) for group in started), "on a command line"
    assert "DDPKIT_JOB_SECRET" not in os.environ, "this process's environment is left alone"
    monkeypatch.setenv("DDPKIT_JOB_SECRET", JOB_SECRET)
    _job.run_replica_groups(
        _job.script_groups("train.py", [], max_restarts=0), groups=2, lighthouse="http://127.0.0.1:9"
    )
    assert {group.env["DDPKIT_JOB_SECRET"] for group in started[6:]} == {JOB_SECRET}


def test_a_replica_group_started_by_hand_draws_no_secret_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under its own ``ddpkit run`` (TORCHFT_LIGHTHOUSE set), a group without a secret gets none: the job's other
    groups could not share one it drew. (It warns when it joins.)"""
    from ddpkit.jobs._agent import agent_scope

    monkeypatch.delenv("DDPKIT_JOB_SECRET", raising=False)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:9")
    with agent_scope(1):
        assert "DDPKIT_JOB_SECRET" not in os.environ
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE")
    with agent_scope(1):
        assert re.fullmatch(r"[0-9a-f]{64}", os.environ["DDPKIT_JOB_SECRET"])


def test_a_replica_group_without_a_secret_warns_once_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddpkit.fault_tolerance import _replica, serve_lighthouse

    monkeypatch.delenv("DDPKIT_JOB_SECRET", raising=False)
    monkeypatch.setattr(_replica, "_warned_without_secret", False)
    with serve_lighthouse("127.0.0.1") as lighthouse:
        said = r"no job secret \(\$DDPKIT_JOB_SECRET\): any process that reaches the lighthouse can join the quorum"
        with pytest.warns(RuntimeWarning, match=said + ".*ddpkit run --fault-tolerance"):
            group = _replica.ReplicaGroup(lighthouse.address, "r0", dict, lambda state: None, timeout=5.0)
        group.close()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _replica.ReplicaGroup(lighthouse.address, "r1", dict, lambda state: None, timeout=5.0).close()
