"""With a job secret, nobody else joins a job: the rendezvous is signed end to end (its state, bound to the job and
a counter; every key of a round), and every new process group proves its members before a tensor moves.

Here, the tests that need no process; the others are in tests/ranks/test_nobody_else_joins.py and
tests/e2e/test_nobody_else_joins.py.
"""

from __future__ import annotations

import base64
import os
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import GroupProofError
from ddpkit._trust.secret import SIGNED_MARK, use_job_secret
from ddpkit.jobs import _rendezvous
from tests.helpers import JOB_SECRET, OTHER_SECRET, rendezvous_handler, state_holder

SECRET = JOB_SECRET.encode()
_REFUSED = r"\) was not written by a rendezvous agent of this job and was refused: "


def _store() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def _state(store: TCPStore) -> bytes:
    return bytes(store.get("torch.rendezvous.job"))


# --- the rendezvous's keys ----------------------------------------------------------------------


def test_every_key_of_a_round_is_signed_and_one_a_stranger_wrote_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """MASTER_ADDR, MASTER_PORT and the ranks travel through plain keys of the round's store: with a secret each
    value is signed for its job, round and key, and a value a stranger wrote there (plain, or signed for another
    key or round) is refused by the agent that reads it."""
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    info = handler.next_rendezvous()
    round_store = info.store
    round_ = handler._state_holder.state.round
    raw = f"torch.rendezvous.job.{round_}/MASTER_ADDR"
    assert bytes(store.get(raw)).startswith(SIGNED_MARK), "what torch's agent wrote is signed"
    assert round_store.get("MASTER_ADDR").decode() == info.bootstrap_store_info.master_addr
    port_key = f"torch.rendezvous.job.{round_}/MASTER_PORT"
    assert int(round_store.get("MASTER_PORT")) == info.bootstrap_store_info.master_port
    signed_addr = bytes(store.get(raw))
    where = rf"the value of torch\.rendezvous\.job\.{round_}/"
    for key, value, why in (
        (raw, b"10.9.9.9", "it is not signed, and this node has a job secret"),
        (port_key, signed_addr, "its signature does not match this node's job secret"),  # another key's
    ):
        store.set(key, value)
        with pytest.raises(_rendezvous.StateRefusedError, match=where + ".*" + why) as caught:
            round_store.get(key.rsplit("/", 1)[1])
        assert "Nothing of it ran" in str(caught.value)
    next_round = _rendezvous.SignedRoundStore(
        dist.PrefixStore(f"torch.rendezvous.job.{round_ + 1}", store),
        handler._state_holder._backend,
        f"torch.rendezvous.job.{round_ + 1}/",
    )
    store.set(f"torch.rendezvous.job.{round_ + 1}/MASTER_ADDR", signed_addr)  # this round's, replayed in the next
    with pytest.raises(_rendezvous.StateRefusedError, match="signature does not match"):
        next_round.get("MASTER_ADDR")
    round_store.multi_set(["torchelastic/assigned_ranks/0"], ["[0, 2, 0, 2]"])
    assert round_store.multi_get(["torchelastic/assigned_ranks/0"]) == [b"[0, 2, 0, 2]"]
    store.set(f"torch.rendezvous.job.{round_}/torchelastic/assigned_ranks/0", "[1, 2, 1, 2]")
    with pytest.raises(_rendezvous.StateRefusedError, match=r"assigned_ranks/0 .*it is not signed"):
        round_store.multi_get(["torchelastic/assigned_ranks/0"])
    handler.shutdown()


def test_without_a_secret_the_rounds_keys_are_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    handler = rendezvous_handler(store, None, monkeypatch)
    info = handler.next_rendezvous()
    assert not isinstance(info.store, _rendezvous.SignedRoundStore)
    assert store.get(f"torch.rendezvous.job.{handler._state_holder.state.round}/MASTER_ADDR").decode() == (
        info.bootstrap_store_info.master_addr
    )
    handler.shutdown()


# --- the rendezvous's state: current, and of this job --------------------------------------------


def test_a_replayed_older_state_of_the_job_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each signed state carries a counter one above the last one its writer read: an older state written back (a
    replay of what a stranger captured earlier) is refused by every agent that has read a newer one."""
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    handler.next_rendezvous()
    older = _state(store)
    handler.set_closed()  # a newer state
    newer = _state(store)
    assert newer != older
    holder = state_holder(handler)
    holder.sync()
    store.set("torch.rendezvous.job", older)
    with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + "it is an older state of this job, replayed"):
        holder.sync()
    store.set("torch.rendezvous.job", newer)
    holder.sync()  # the current state still passes
    assert holder.state.closed
    handler.shutdown()


def test_a_state_signed_in_an_earlier_job_with_the_same_secret_and_run_id_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every signature binds the job's id, which the store's first agent draws at random: a state of an earlier job
    (same secret, same run id) does not verify in this one."""
    earlier_store = _store()
    earlier = rendezvous_handler(earlier_store, SECRET, monkeypatch)
    earlier.next_rendezvous()
    captured = _state(earlier_store)
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    holder = state_holder(handler)
    assert store.get(_rendezvous.job_key("job")) != earlier_store.get(_rendezvous.job_key("job")), "a new job id"
    store.set("torch.rendezvous.job", captured)
    with pytest.raises(_rendezvous.StateRefusedError, match=_REFUSED + ".*or it was signed for another job"):
        holder.sync()
    earlier.shutdown()


def test_the_stores_host_refuses_a_job_id_someone_wrote_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    earlier = _store()
    first = _rendezvous.claim_job(earlier, "job", "here", SECRET)
    assert _rendezvous.claim_job(earlier, "job", "here", SECRET) == first, "the others take the host's"
    store = _store()
    store.set(_rendezvous.job_key("job"), earlier.get(_rendezvous.job_key("job")))  # a stranger replays it first
    with pytest.raises(_rendezvous.StateRefusedError, match="someone wrote a job id before this agent"):
        _rendezvous.claim_job(store, "job", "here", SECRET, first=True)
    forged = _store()
    forged.set(_rendezvous.job_key("job"), b"0123456789abcdef")
    with pytest.raises(_rendezvous.StateRefusedError, match=r"the job id .* it is not signed"):
        _rendezvous.claim_job(forged, "job", "here", SECRET)


def test_a_refusal_names_the_secret_file_the_node_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    holder = state_holder(handler)
    use_job_secret(OTHER_SECRET.encode(), "--secret-file /etc/job.key")
    try:
        store.set("torch.rendezvous.job", base64.b64encode(b"not signed"))
        with pytest.raises(_rendezvous.StateRefusedError, match=r"this node.s is from --secret-file /etc/job\.key"):
            holder.sync()
    finally:
        use_job_secret(None)


# --- the default group's store: signed ----------------------------------------------------------


def test_clones_of_the_signed_store_sign_and_outlive_torchs_hold_on_them() -> None:
    """The hang watchdog's own connection is a clone of the default group's store, made by torch's prefix store
    through the signed one (torch holds only the C++ part of a store written in Python, and cannot call its
    methods once the Python object is gone, so every clone is kept alive with its store): it signs what it
    writes, refuses what nobody with the secret wrote, and two ranks' clones meet."""
    import gc

    from ddpkit._trust.group_store import SignedStore

    base = _store()
    signed = [SignedStore(dist.PrefixStore("default_pg", base), SECRET, "job") for _ in "ab"]  # type: ignore[attr-defined]
    mine, theirs = (dist.PrefixStore("0/", store).clone() for store in signed)  # type: ignore[attr-defined]
    gc.collect()
    mine.set("ddpkit/hang/answer/0", b"state")
    assert theirs.get("ddpkit/hang/answer/0") == b"state"
    assert bytes(base.get("default_pg/0//ddpkit/hang/answer/0")).endswith(b"state"), "not under torch's default_pg"
    base.set("default_pg/0//ddpkit/hang/answer/1", b"a stranger's")
    with pytest.raises(GroupProofError, match=r"the value of the key '0//ddpkit/hang/answer/1' in the group's store"):
        mine.get("ddpkit/hang/answer/1")


#: A member's gloo address as torch 2.13's gloo writes it in the store (read from a real group): its host name
#: ("vm") and its sockaddr_storage (127.0.0.1:35779), each after its length, then more. The sockaddr_storage's
#: padding holds whatever memory gloo left there: here bytes that read as an IPv6 address further on.
_GLOO_ADDRESS = bytes.fromhex(
    "0200000000000000766d880000000000000002008bc37f00000100000000000000003facbc73bc3ebfbfbfbfbfbfbfbfbfbf0000000000"
    "0000000000000000000000000000000000000000000000000000002d2e2324efeff1bfdfbfdf3631283333242ddf2138df322b34312cec"
    "342fed320000000000000000000000000000000000000000000000000000000000000000ffffffffffffffff0000000000000000010000"
    "0000000000"
)


def test_the_address_in_a_members_store_value_is_read_from_gloos_layout_not_from_its_padding() -> None:
    from ddpkit._trust.group_store import gloo_address, member_address
    from ddpkit._trust.secret import sign

    assert gloo_address(_GLOO_ADDRESS) == "127.0.0.1:35779"
    assert member_address(_GLOO_ADDRESS) == "127.0.0.1:35779", "a stranger's own, unsigned"
    signed = sign(os.urandom(32), "ddpkit group store", _GLOO_ADDRESS, "group", "key")
    assert member_address(signed) == "127.0.0.1:35779", "signed with another secret"
    assert member_address(os.urandom(32) + _GLOO_ADDRESS) == "127.0.0.1:35779", "signed by an earlier ddpkit"
    earlier = _GLOO_ADDRESS[18 : 18 + 136]  # the sockaddr_storage first, as gloo wrote it before torch 2.13
    assert gloo_address(earlier) == "127.0.0.1:35779"
    assert gloo_address(b"not an address") == ""
