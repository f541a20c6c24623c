"""One format for every value ddpkit signs with the job secret (a mark, a version byte, HMAC-SHA256, the value):
the rendezvous's state and keys, a group's store, a group's own keys, a replica group's store record. A value of
another format (an earlier ddpkit's, another version byte) is refused, saying so."""

from __future__ import annotations

import base64
import logging
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from ddpkit import GroupProofError
from ddpkit._trust import sealed as _sealed
from ddpkit._trust.group_store import _STORE_PURPOSE, SignedStore
from ddpkit._trust.sealed import SealedKeys
from ddpkit._trust.secret import (
    OLD_SIGNED_MARKS,
    SIGNED_HEADER_BYTES,
    SIGNED_MARK,
    SIGNED_VERSION,
    SignatureError,
    sign,
    signed_value,
)
from ddpkit.fault_tolerance._quorum_proof import OWNER_KEY, check_store_owner, claim_store
from ddpkit.jobs import _rendezvous
from tests.helpers import JOB_SECRET, rendezvous_handler, state_holder

SECRET = JOB_SECRET.encode()
SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"


def _store() -> Any:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_a_signed_value_reads_back_only_with_its_secret_purpose_and_bound_parts() -> None:
    stored = sign(SECRET, "purpose", b"value", "group", 3)
    assert stored[: len(SIGNED_MARK) + 1] == SIGNED_MARK + bytes([SIGNED_VERSION])
    assert len(stored) == SIGNED_HEADER_BYTES + len(b"value")
    assert signed_value(SECRET, "purpose", stored, "group", 3) == b"value"
    # The rendezvous's names for the layout, as tests that take a signed state apart read them.
    assert len(_rendezvous._SIGNED) + _rendezvous._DIGEST == SIGNED_HEADER_BYTES
    assert stored.startswith(_rendezvous._SIGNED_VALUE)
    for secret, purpose, bound in (
        (b"another secret of enough length, 0123456789", "purpose", ("group", 3)),
        (SECRET, "another purpose", ("group", 3)),
        (SECRET, "purpose", ("group", 4)),
        (SECRET, "purpose", ("group3",)),  # parts are length-prefixed: no two lists of parts read the same
    ):
        with pytest.raises(SignatureError, match="its signature does not match") as caught:
            signed_value(secret, purpose, stored, *bound)
        assert caught.value.kind == "mismatch"
    for at in range(len(SIGNED_MARK) + 1, len(stored)):  # any byte of the tag or the value changed
        changed = stored[:at] + bytes([stored[at] ^ 1]) + stored[at + 1 :]
        with pytest.raises(SignatureError) as caught:
            signed_value(SECRET, "purpose", changed, "group", 3)
        assert caught.value.kind == "mismatch"


def test_a_value_of_another_format_is_refused_as_another_versions() -> None:
    stored = sign(SECRET, "purpose", b"value")
    other = SIGNED_MARK + bytes([SIGNED_VERSION + 1]) + stored[len(SIGNED_MARK) + 1 :]
    with pytest.raises(SignatureError, match=f"it is signed in format 2, this ddpkit's is {SIGNED_VERSION}") as caught:
        signed_value(SECRET, "purpose", other)
    assert caught.value.kind == "version"
    for mark in OLD_SIGNED_MARKS:
        with pytest.raises(SignatureError, match="an earlier ddpkit's format") as caught:
            signed_value(SECRET, "purpose", mark + stored[len(SIGNED_MARK) + 1 :])
        assert caught.value.kind == "version"
    with pytest.raises(SignatureError, match="it is not signed") as caught:
        signed_value(SECRET, "purpose", b"value")
    assert caught.value.kind == "unsigned"


def test_every_place_that_stores_a_signed_value_writes_the_one_format(monkeypatch: pytest.MonkeyPatch) -> None:
    header = SIGNED_MARK + bytes([SIGNED_VERSION])
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    info = handler.next_rendezvous()
    assert base64.b64decode(store.get("torch.rendezvous.job")).startswith(header), "the rendezvous's state"
    round_ = handler._state_holder.state.round
    assert bytes(store.get(f"torch.rendezvous.job.{round_}/MASTER_ADDR")).startswith(header), "a round's key"
    assert info.store.get("MASTER_ADDR").decode() == info.bootstrap_store_info.master_addr
    handler.shutdown()
    SignedStore(store, SECRET, "group").set("gloo/0", b"address")
    assert bytes(store.get("gloo/0")) == sign(SECRET, _STORE_PURPOSE, b"address", "group", "gloo/0")
    SealedKeys(store, SECRET, "group").put("hang/0", b"asked")
    assert bytes(store.get("hang/0")).startswith(header), "a group's own key (not private)"
    host, port = "127.0.0.1", store.port
    claim_store(f"{host}:{port}", "group-0:uuid", SECRET)
    assert bytes(store.get(OWNER_KEY)).startswith(header), "a replica group's store record"
    check_store_owner(f"{host}:{port}/prefix", ["group-0:uuid"], SECRET, 5.0)


def test_each_reader_refuses_an_earlier_ddpkits_signed_value_saying_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store()
    handler = rendezvous_handler(store, SECRET, monkeypatch)
    handler.next_rendezvous()
    holder = state_holder(handler)
    holder.sync()
    stored = base64.b64decode(store.get("torch.rendezvous.job"))
    old = OLD_SIGNED_MARKS[0] + stored[len(SIGNED_MARK) + 1 :]
    store.set("torch.rendezvous.job", base64.b64encode(old))
    with pytest.raises(_rendezvous.StateRefusedError, match="it is signed in an earlier ddpkit's format"):
        holder.sync()
    handler.shutdown()

    signed = SignedStore(store, SECRET, "group")
    signed.set("gloo/1", b"value")
    store.set("gloo/1", OLD_SIGNED_MARKS[1] + bytes(store.get("gloo/1"))[len(SIGNED_MARK) + 1 :])
    with pytest.raises(GroupProofError, match=re.escape("(it is signed in an earlier ddpkit's format")):
        signed.get("gloo/1")

    monkeypatch.setattr(_sealed, "_said_old", False)
    keys = SealedKeys(store, SECRET, "group")
    keys.put("hang/1", b"asked")
    store.set("hang/1", OLD_SIGNED_MARKS[2] + bytes(store.get("hang/1"))[len(SIGNED_MARK) + 1 :])
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        assert keys.read("hang/1") is None
    assert any("was signed by an earlier ddpkit (a format no longer read)" in r.getMessage() for r in caplog.records)

    claim_store(f"127.0.0.1:{store.port}", "group-0:uuid", SECRET)
    store.set(OWNER_KEY, OLD_SIGNED_MARKS[0] + bytes(store.get(OWNER_KEY))[len(SIGNED_MARK) + 1 :])
    with pytest.raises(GroupProofError, match="an earlier ddpkit's format"):
        check_store_owner(f"127.0.0.1:{store.port}/prefix", ["group-0:uuid"], SECRET, 5.0)


def test_only_the_secret_module_makes_a_tag_or_writes_the_signed_format() -> None:
    """One tag format: no other module of ddpkit computes an HMAC or lays out a signed value of its own (the group
    proof's answers, not stored, are tags too)."""
    makers = sorted(
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.name != "secret.py" and re.search(r"hmac\.new|hmac\.digest|ddpkit-(signed|hmac)", path.read_text())
    )
    assert makers == []
