"""The store a new process group's members meet at, with a job secret: what the group is, its id, and every
value signed (private).

Before a group's members can prove anything to each other over the group's
connections (:mod:`ddpkit._trust.group_proof`), they tell each other in the group's
store where they listen. With a job secret, everything there is signed for
the group (:class:`SignedStore`): nobody else can put its own address in place
of a member's and relay between members. *For the group* means bound to a
context that is the same on every member and on no earlier group: the store's
address, torchrun's run id and attempt, the id ddpkit's launcher drew for the
job, and an id that the group's rank 0 draws for this group alone and signs
into the store first (:func:`agree_on_group_id`), so nothing signed in an
earlier job passes, even with the same secret, the same store address and the
same run id.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit._stores import ForwardingStore
from ddpkit._torch_private import default_store
from ddpkit._trust.sealed import SealedKeys
from ddpkit._trust.secret import (
    DIGEST_BYTES,
    GUIDE,
    SIGNED_HEADER_BYTES,
    SIGNED_MARK,
    SignatureError,
    secret_source,
    sign,
    signed_value,
)
from ddpkit.errors import GroupProofError

__all__ = [
    "JOB_ID_VARIABLE",
    "SignedStore",
    "agree_on_group_id",
    "default_group_context",
    "gloo_address",
    "gloo_addresses",
    "member_address",
]

_STORE_PURPOSE = "ddpkit group store v1"
#: The key of a group's id in its store (then the number of groups made in this process: see the function).
_GROUP_ID_KEY = "ddpkit/group-id"


#: The environment variable in which ddpkit's launchers hand their workers the job's random id (hex).
JOB_ID_VARIABLE = "DDPKIT_JOB_ID"


def default_group_context(address: str | None = None, port: int | str | None = None, job: str = "") -> str:
    """What the default process group is, the same text on every rank: the store its ranks meet at (``address``
    and ``port``, default ``MASTER_ADDR`` and ``MASTER_PORT``), torchrun's run id and attempt, the id that
    ddpkit's launcher drew for the job (``DDPKIT_JOB_ID``), and ``job`` (the id its rank 0 drew for this group).
    What is signed for one group does not verify in another."""
    address = os.environ.get("MASTER_ADDR", "") if address is None else address
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return f"default group|{address}:{port}|{run}|{attempt}|{os.environ.get(JOB_ID_VARIABLE, '')}|{job}"


def agree_on_group_id(
    store: Any, rank: int, size: int, context: str, secret: bytes, timeout: float, where: str, number: int = 0
) -> str:
    """This group's id, the same on every member: rank 0 draws a random one and signs it into ``store`` first;
    every other rank asks for it with a fresh nonce and takes only rank 0's signed answer to that nonce, so a
    value written back from an earlier job or group is never taken. Every member must call it, before the group is
    made, with the same ``context`` and ``number`` (how many groups this process made on this store before).

    Args:
        store: the group's store (the default group's ``default_pg`` prefix).
        rank: this member's rank; size: the group's size.
        context: what the group is before it has an id (:func:`default_group_context`).
        secret: the job secret.
        timeout: seconds rank 0 answers questions for (in the background), and each rank waits for its answer.
        where: the store's ``HOST:PORT``, for messages.
        number: how many groups this process made on this store before.

    Raises:
        GroupProofError: on rank 0, the store held a signed id before it wrote one (only a replay of an earlier
            group's can be there: rank 0 alone writes it); elsewhere, rank 0 refused the store or did not answer
            within ``timeout``. Each names the store at ``where`` (``HOST:PORT``); the group is not made.
    """
    keys = SealedKeys(store, secret, context)
    key = f"{_GROUP_ID_KEY}/{number}"
    if rank == 0:
        drawn = secrets.token_hex(16).encode()
        if keys.claim(key, drawn) != drawn:
            keys.put(f"{key}/refused", b"a replay")  # the others stop at once, instead of waiting for an answer
            raise GroupProofError(
                f"the group's store at {where} held an id for this group, signed with the job secret "
                f"({secret_source()}), before rank 0 drew one: a program that reached the store wrote back one from "
                "an earlier job or group (a replay). The group was not made; nothing of the job's data moved. Keep "
                f"the job's ports where only the job reaches them; see {GUIDE}"
            )
        # Each rank's question is answered in the background, while rank 0 goes on making the group (and refuses
        # at once what a stranger wrote there in a rank's place): no rank makes the group before its answer.
        answering = SealedKeys(_own_connection(store), secret, context)
        threading.Thread(target=_answer, args=(answering, key, drawn, size, timeout), name="ddpkit-group-id",
                         daemon=True).start()  # fmt: skip
        return drawn.decode()
    nonce = secrets.token_hex(16).encode()
    keys.put(f"{key}/ask/{rank}", nonce)
    answered = _wait_for(keys, f"{key}/answer/{rank}", timeout, lambda value: value.startswith(nonce + b"|"),
                         refused=f"{key}/refused")  # fmt: skip
    if answered is None or not answered.startswith(nonce + b"|"):
        whys = {
            None: f"rank 0 did not answer within {timeout:g} s: it did not start, runs without the job secret "
            f"({secret_source()}) or with another, or the store is not the job's",
            b"gone": "the store went away before rank 0 answered: rank 0 stopped (its own message says why; it "
            "may have found a value written back from an earlier job there)",
        }
        why = whys.get(answered, "rank 0 found a value written back from an earlier job or group there (a replay) "
                                 "and refused it")  # fmt: skip
        raise GroupProofError(f"this group's id could not be agreed in its store at {where}: {why}. The group was "
                              f"not made; nothing of the job's data moved; see {GUIDE}")  # fmt: skip
    return answered[len(nonce) + 1 :].decode()


def _own_connection(store: Any) -> Any:
    """A connection of its own to ``store`` (its clone), or ``store`` where it cannot be cloned."""
    try:
        return store.clone()
    except (RuntimeError, AttributeError):
        return store


def _answer(keys: SealedKeys, key: str, drawn: bytes, size: int, timeout: float) -> None:
    """Rank 0's side: answer each rank's question (its nonce) with the group's id, signed; give up on a rank that
    does not ask within ``timeout`` (the group then fails to form without it anyway)."""
    try:
        for member in range(1, size):
            asked = _wait_for(keys, f"{key}/ask/{member}", timeout, lambda value: True)
            if asked is None or asked == b"gone":
                return
            keys.put(f"{key}/answer/{member}", asked + b"|" + drawn)
    except Exception:  # the store went away: the group is gone
        return


def _wait_for(
    keys: SealedKeys, key: str, timeout: float, accept: Callable[[bytes], bool], refused: str | None = None
) -> bytes | None:
    """The group's value of ``key`` that ``accept`` takes, once it is there; the value of ``refused`` if that
    comes first; ``None`` after ``timeout`` seconds (a stranger's values do not count). The store tells when the
    key appears (``wait``), so nobody polls it."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            keys.store.wait([key], timedelta(seconds=min(0.5, left)))
        except dist.DistStoreError:  # not there yet
            pass
        except Exception:  # the store went away (with rank 0, which hosted it)
            return b"gone"
        else:
            try:
                value = keys.read(key)
            except Exception:  # it went away since (rank 0 refused the store and stopped): its message says why
                return b"gone"
            if value is not None and accept(value):
                return value
            time.sleep(0.05)  # there, but a stranger's (or an earlier one): look again
        try:
            if refused is not None and (stop := keys.read(refused)) is not None:
                return stop
        except Exception:  # the store went away (with rank 0, which hosted it)
            return b"gone"
    return None


def gloo_addresses(group: dist.ProcessGroup | None = None) -> dict[int, str]:
    """``{rank in the group: "HOST:PORT"}``: where each member of a gloo ``group`` said it listens, as gloo wrote it
    in the default group's store when the group was made (``{}`` where that cannot be read).

    This is what the other members connected to, so for a member that is not
    who it should be, it is the address of whoever took its place.
    """
    try:
        store: Any = default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        name, size = pg.group_name, dist.get_world_size(group)
        prefix = "" if isinstance(store, SignedStore) else "default_pg/"  # a signed store holds "default_pg" in it
        keys = {f"{prefix}{name}//cpu//0/{member}": member for member in range(size)}
        present = [key for key in keys if store.check([key])]
        return {keys[key]: address for key in present if (address := gloo_address(bytes(store.get(key))))}
    except Exception:  # another backend or store: the message goes without addresses
        return {}


def sockaddr(data: bytes) -> str:
    """The IPv4 or IPv6 socket address (``sockaddr_in``/``sockaddr_in6``, as Linux lays them out) at the start of
    ``data``; ``""`` when there is none."""
    if len(data) < 8:
        return ""
    family, port = int.from_bytes(data[:2], "little"), int.from_bytes(data[2:4], "big")
    if family == socket.AF_INET and port:
        return f"{ipaddress.IPv4Address(data[4:8])}:{port}"
    if family == socket.AF_INET6 and port and len(data) >= 24:
        return f"[{ipaddress.IPv6Address(data[8:24])}]:{port}"
    return ""


def gloo_address(data: bytes) -> str:
    """The socket address in gloo's address of a member: its host name and its ``sockaddr_storage``, each after
    its length (8 bytes, little-endian), as torch 2.13's gloo writes it, or the ``sockaddr_storage`` first, as
    earlier ones did; ``""`` when ``data`` is neither. Nothing else is read: the ``sockaddr_storage``'s padding
    is whatever memory gloo left there."""
    name = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
    if 0 <= name <= 255 and len(data) >= 16 + name:
        size = int.from_bytes(data[8 + name : 16 + name], "little")
        if 8 <= size <= len(data) - 16 - name:
            return sockaddr(data[16 + name : 16 + name + size])
    return sockaddr(data)


def member_address(raw: bytes) -> str:
    """The socket address in a store value that holds a member's gloo address, signed (with another secret; by an
    earlier ddpkit, whose value was the tag, then the address) or not (a stranger's own); ``""`` when none is
    found."""
    if raw.startswith(SIGNED_MARK):
        return gloo_address(raw[SIGNED_HEADER_BYTES:])
    return gloo_address(raw[DIGEST_BYTES:]) or gloo_address(raw)


class SignedStore(ForwardingStore):
    """A group's store as its backend sees it: each value this member writes is signed (HMAC-SHA256 with the
    job secret, bound to ``context`` and the key), and each value it reads must be, so that nobody else can
    put its own address in place of a member's (and sit between two members). Counters (``add``) are not
    signed: a stranger can only make a count wrong, which stops the group (a disruption, not a way in).

    Every member of the group must wrap its store the same way, with the same ``context``.

    Args:
        inner: the store (e.g. the group's prefix store).
        secret: the job secret.
        context: what the group is (the same text on every member).
        name_key: what a key's value is, for the message (default: "the value of the key ...").

    Raises (from ``get``):
        GroupProofError: a value that is not signed for this group and key (naming the key and its member).
    """

    def __init__(self, inner: Any, secret: bytes, context: str, name_key: Callable[[str], str] | None = None) -> None:
        super().__init__(inner)
        self._secret, self.context = secret, context
        self._name_key = name_key or (lambda key: f"the value of the key {key!r}")
        self._clones: list[SignedStore] = []
        #: Each member's gloo listening addresses by rank, as written (this member's) and read (the others',
        #: once verified) through this store: where the members told each other they listen.
        self.addresses: dict[int, list[str]] = {}

    def clone(self) -> SignedStore:
        """The same store on a connection of its own (as torch's ``Store.clone``). The clone is kept alive with
        this store: torch's stores that clone through this one hold only its C++ part, which needs it."""
        clone = SignedStore(self._inner.clone(), self._secret, self.context, self._name_key)
        clone.addresses = self.addresses
        self._clones.append(clone)
        return clone

    def _record(self, key: str, value: bytes) -> None:
        """Keep ``value`` as a member's listening address when ``key`` is gloo's key of one (``.../DEVICE/RANK``)."""
        device, _, member = key.rpartition("/")
        if member.isdigit() and device.rpartition("/")[2].isdigit() and (address := gloo_address(value)):
            found = self.addresses.setdefault(int(member), [])
            if address not in found:
                found.append(address)

    def _signed(self, key: str, value: bytes | str) -> bytes:
        return sign(self._secret, _STORE_PURPOSE, value.encode() if isinstance(value, str) else bytes(value),
                    self.context, key)  # fmt: skip

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._signed(key, data))
        self._record(key, data)

    def get(self, key: str) -> bytes:
        raw = bytes(self._inner.get(key))
        try:
            value = signed_value(self._secret, _STORE_PURPOSE, raw, self.context, key)
        except SignatureError as refused:
            name = self._name_key(key)
            # An address: where it would have sent the group (signed with another secret, or a stranger's own).
            pointed = member_address(raw) if "address" in name else ""
            another = f" ({refused.reason})" if refused.kind == "version" else ""
            raise GroupProofError(
                f"{name} in the group's store{f' (it points to {pointed})' if pointed else ''} was not written by a "
                f"process that holds the job secret ({secret_source()}) for this group{another}: a program that "
                "reached the store put its own there, or one from an earlier job or group (a replay), or that member "
                "runs with another secret. The group was not made; nothing of the job's "
                f"data moved. Give every process of the job the same secret, and keep the job's ports where only "
                f"the job reaches them; see {GUIDE}"
            ) from None
        self._record(key, value)
        return value

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """torch's ``compare_set`` of signed values: ``expected`` (``""``: the key is absent) and ``desired`` are
        signed as :meth:`set` signs them; the value there afterwards, once its signature verified."""

        old = self._signed(key, expected) if expected else b""
        self._inner.compare_set(key, old, self._signed(key, desired))
        return self.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        try:
            if timeout is None:
                self._inner.wait(keys)
            else:
                self._inner.wait(keys, timeout)
        except Exception as exc:
            missing = [key for key in keys if not self._present(key)] or keys
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise GroupProofError(
                f"{', '.join(map(self._name_key, missing))} did not reach the group's store in time "
                f"({first_line}): that member left, or is not a process of the job. The group was not made; nothing "
                "of the job's data moved."
            ) from None

    def _present(self, key: str) -> bool:
        try:
            return bool(self._inner.check([key]))
        except Exception:
            return False
