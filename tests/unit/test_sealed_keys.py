"""A group's own keys in its store: what a stranger writes there reads as absent, what a rank seals there reads as
noise to anyone without the secret."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpkit._trust.group_store import SignedStore
from ddpkit._trust.sealed import SealedKeys
from tests.helpers import JOB_SECRET, OTHER_SECRET

SECRET = JOB_SECRET.encode()


@pytest.fixture
def store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def test_signed_and_private_values_read_back_for_the_group_only(store: dist.Store) -> None:
    keys = SealedKeys(store, SECRET, "default group|127.0.0.1:1|run|0|job|a1")
    answer = json.dumps({"host": "node-17", "pid": 4242, "threads": [["/home/me/train.py", 12, "step"]]}).encode()
    keys.put("ddpkit/hang/answer/1", answer, private=True)
    keys.put("ddpkit/hang/trigger", b"0")
    assert keys.read("ddpkit/hang/answer/1") == answer
    assert keys.read("ddpkit/hang/trigger") == b"0"
    raw = bytes(store.get("ddpkit/hang/answer/1"))
    for visible in (b"node-17", b"4242", b"train.py", b"host", b"threads"):
        assert visible not in raw, "a private value is encrypted"
    assert len(raw) < len(answer) + 80
    assert keys.read("absent") is None
    for context, secret in (("default group|127.0.0.1:1|run|0|job|a2", SECRET), (keys._context, OTHER_SECRET.encode())):
        other = SealedKeys(store, secret, context)  # another job (or attempt, or store), or another secret
        assert other.read("ddpkit/hang/answer/1") is None
        assert other.read("ddpkit/hang/trigger") is None


def test_a_strangers_write_reads_as_absent_and_a_copy_under_another_key_too(store: dist.Store) -> None:
    keys = SealedKeys(store, SECRET, "ctx")
    store.set("ddpkit/hang/trigger", b"1")  # what a stranger without the secret can write
    assert keys.read("ddpkit/hang/trigger") is None
    keys.put("ddpkit/hang/answer/0", b"rank 0's", private=True)
    store.set("ddpkit/hang/answer/1", store.get("ddpkit/hang/answer/0"))  # copied to another rank's key
    assert keys.read("ddpkit/hang/answer/1") is None
    keys.put("ddpkit/hang/done", b"/tmp/report")
    store.set("ddpkit/hang/trigger", store.get("ddpkit/hang/done"))
    assert keys.read("ddpkit/hang/trigger") is None
    sealed = bytearray(store.get("ddpkit/hang/answer/0"))
    sealed[-1] ^= 1  # one bit of the ciphertext changed
    store.set("ddpkit/hang/answer/0", bytes(sealed))
    assert keys.read("ddpkit/hang/answer/0") is None


def test_the_first_rank_to_claim_a_key_holds_it_and_a_strangers_value_there_does_not_count(store: dist.Store) -> None:
    keys = SealedKeys(store, SECRET, "ctx")
    assert keys.claim("trigger", b"1") == b"1"
    assert keys.claim("trigger", b"0") == b"1", "the first claim wins"
    store.set("other", b"a stranger's")
    assert keys.claim("other", b"0") == b"0", "a stranger's value is no claim"
    assert keys.read("other") == b"0"


def test_through_the_default_groups_signed_store_and_torchs_prefixes(store: dist.Store) -> None:
    """The watchdog's connection: a clone of torch's prefix store over ddpkit's signed store."""
    signed = SignedStore(dist.PrefixStore("default_pg", store), SECRET, "ctx")
    clone = dist.PrefixStore("0", signed).clone()
    keys = SealedKeys(clone, SECRET, "ctx")
    assert keys.claim("ddpkit/hang/trigger", b"1") == b"1"
    assert keys.claim("ddpkit/hang/trigger", b"0") == b"1"
    (key,) = [k for k in store.list_keys() if k.endswith("ddpkit/hang/trigger")]
    store.set(key, b"1")  # a stranger who listed the keys
    assert keys.read("ddpkit/hang/trigger") is None
    assert keys.claim("ddpkit/hang/trigger", b"0") == b"0"


def test_without_a_secret_values_are_stored_as_they_are(store: dist.Store) -> None:
    keys = SealedKeys(store, None, "ctx")
    keys.put("a", b"plain", private=True)
    assert bytes(store.get("a")) == b"plain"
    assert keys.read("a") == b"plain"
    assert not keys.signed


def test_a_groups_id_is_rank_0s_fresh_one_and_one_written_back_from_an_earlier_group_is_refused(
    store: dist.Store,
) -> None:
    import threading

    from ddpkit import GroupProofError
    from ddpkit._trust.group_store import agree_on_group_id

    def agree(where: dist.Store, size: int) -> list[object]:
        found: list[object] = [None] * size

        def one(rank: int) -> None:
            try:
                found[rank] = agree_on_group_id(where, rank, size, "ctx", SECRET, 5.0, "127.0.0.1:1")
            except GroupProofError as exc:
                found[rank] = exc

        threads = [threading.Thread(target=one, args=(rank,)) for rank in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        return found

    first = agree(store, 3)
    assert isinstance(first[0], str)
    assert first == [first[0]] * 3, "every rank takes rank 0's id"
    # The next job with the same secret and store address: a stranger writes job 1's values back first.
    later = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    for key in store.list_keys():
        later.set(key, store.get(key))
    second = agree(later, 3)
    assert isinstance(second[0], GroupProofError)
    assert "held an id for this group, signed with the job secret" in str(second[0])
    for rank in (1, 2):
        assert isinstance(second[rank], GroupProofError), "no rank takes the id written back, nor its old answer"
        assert "could not be agreed in its store at 127.0.0.1:1: rank 0 found a value written back" in str(second[rank])


def test_a_rank_whose_store_goes_away_just_as_its_answer_is_there_says_rank_0_stopped(store: dist.Store) -> None:
    """Rank 0 refuses a replayed store and stops, taking the store with it, between another rank's wait for its
    answer and its read: that rank says the store went away (not a raw connection error)."""
    from ddpkit import GroupProofError
    from ddpkit._trust.group_store import agree_on_group_id

    class GoneAfterWait:
        def __init__(self, inner: dist.Store) -> None:
            self.inner = inner

        def set(self, key: str, value: bytes) -> None:
            self.inner.set(key, value)

        def wait(self, keys: list[str], timeout: timedelta) -> None:
            """The answer is there."""

        def check(self, keys: list[str]) -> bool:
            raise dist.DistNetworkError("Connection reset by peer")

    with pytest.raises(GroupProofError, match="the store went away before rank 0 answered: rank 0 stopped"):
        agree_on_group_id(GoneAfterWait(store), 1, 2, "ctx", SECRET, 5.0, "127.0.0.1:1")


def test_private_values_are_sealed_with_chacha20_poly1305_and_the_old_format_is_refused_once_with_a_warning(
    store: dist.Store, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

    from ddpkit._trust import sealed as _sealed
    from ddpkit._trust.secret import tag

    keys = SealedKeys(store, SECRET, "ctx")
    first, second = keys.seal("k", b"the same value", private=True), keys.seal("k", b"the same value", private=True)
    assert first != second, "a fresh nonce each time"
    prefix = b"ddpkit-sealed-key-v2\0"
    assert first.startswith(prefix)
    nonce, sealed = first[len(prefix) : len(prefix) + 12], first[len(prefix) + 12 :]
    aead = ChaCha20Poly1305(tag(SECRET, "ddpkit group keys: seal", "ctx"))  # the library opens it, no ddpkit code
    assert aead.decrypt(nonce, sealed, b"private" + (1).to_bytes(8, "big") + b"k") == b"the same value"
    monkeypatch.setattr(_sealed, "_said_old", False)
    store.set("old", b"ddpkit-sealed-key-v1\0" + bytes(64))
    store.set("old2", b"ddpkit-sealed-key-v1\0" + bytes(64))
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        assert keys.read("old") is None
        assert keys.read("old2") is None
    said = [r.getMessage() for r in caplog.records if "sealed by ddpkit 0.2" in r.getMessage()]
    assert said == ["the value of 'old' in the group's store was sealed by ddpkit 0.2 (a format no longer read): every "
                    "rank of a job must run the same ddpkit version; the value is ignored"]  # fmt: skip
