"""Every member of a new process group proves that it holds the job secret, before the job's data moves (private).

A challenge and response over the group itself, so that what is proven is who
is at the other end of the group's own connections (not who wrote a key to a
store): each member draws a fresh random nonce, the group all-gathers them,
then each member all-gathers its HMAC tag over the group's context (the job,
the round, the store it met at), its rank and every nonce. Each member checks
every other member's tag. A member without the secret cannot make its tag,
cannot reuse one made for another rank, group or round, and learns nothing it
could use: only random nonces and tags move. A group where any tag is wrong, or
where the proof does not finish within :data:`PROOF_TIMEOUT_S`, raises
:class:`~ddpkit.errors.GroupProofError` on every member that holds the secret.

:class:`SignedStore` covers what comes before: the addresses the members give
each other in the group's store as the group forms, signed so that nobody else
can put its own in place of a member's and relay between members (the default
group's store with a job secret, and each fault-tolerant quorum's).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._secret import DIGEST_BYTES, secret_source, tag
from ddpkit.errors import GroupProofError

__all__ = [
    "GUIDE",
    "NONCE_BYTES",
    "PROOF_COLLECTIVES",
    "PROOF_TIMEOUT_S",
    "TIMEOUT_VARIABLE",
    "SignedStore",
    "check_members",
    "gloo_addresses",
    "member_address",
    "proof_timeout",
    "prove_members",
]

#: Where users read what the job secret protects and how to give it.
GUIDE = "the documentation's Security page (docs/security.md)"

#: Seconds a member waits for the others' nonces, then for their tags, unless ``DDPKIT_PROOF_TIMEOUT`` says.
PROOF_TIMEOUT_S = 60.0
#: The environment variable that sets the proof's deadline, in seconds.
TIMEOUT_VARIABLE = "DDPKIT_PROOF_TIMEOUT"
#: Collectives the proof runs on the group (two all-gathers).
PROOF_COLLECTIVES = 2
#: Bytes of each member's random nonce.
NONCE_BYTES = 32
_PURPOSE = "ddpkit group proof v1"
_STORE_PURPOSE = "ddpkit group store v1"


def prove_members(
    group: dist.ProcessGroup | None,
    context: str,
    secret: bytes,
    *,
    timeout: float | None = None,
    addresses: Callable[[], dict[int, str]] | None = None,
) -> None:
    """Check that every member of ``group`` holds ``secret``; every member must call it, with the same ``context``.

    While it runs, the group's own timeout is ``timeout`` (then restored), so
    a member that does not take part fails the exchange instead of blocking
    it: the group can then be destroyed at once.

    Args:
        group: the new group (``None``: the default group).
        context: what the group is, the same text on every honest member
            (e.g. the job, its round and the store the members met at): a
            proof made for another group does not verify here.
        secret: the job secret.
        timeout: seconds to wait for each of the two exchanges (default
            :func:`proof_timeout`).
        addresses: each member's address by its rank in the group, for the
            message (e.g. :func:`gloo_addresses`); read before the exchange.

    Raises:
        GroupProofError: a member's proof was wrong, or the proofs did not
            arrive within ``timeout`` (naming the members and the fix).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return
    timeout = proof_timeout() if timeout is None else timeout
    found = {member: f"at {address}" for member, address in _addresses_now(addresses).items()}
    device = _device(group)
    restore = _timeout_of(group)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), group)

    def all_gather(value: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(gathered, value, group=group)
        return gathered

    check_members(all_gather, rank, size, context, secret, timeout=timeout, names=found, device=device)
    if restore is not None:
        dist.distributed_c10d._set_pg_timeout(restore, group)


def check_members(
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
    rank: int,
    size: int,
    context: str,
    secret: bytes,
    *,
    timeout: float,
    names: Mapping[int, str] | Callable[[], Mapping[int, str]] | None = None,
    device: torch.device | None = None,
) -> None:
    """The proof itself, over any group: ``all_gather(tensor)`` returns every member's ``tensor`` (a list of
    ``size``, in rank order) and raises when the group fails or times out. Every member must call it.

    Args:
        all_gather: the group's all-gather of one fixed-size ``uint8`` tensor.
        rank: this member's rank in the group.
        size: the group's size.
        context: what the group is, the same text on every honest member.
        secret: the job secret.
        timeout: the seconds after which ``all_gather`` gives up (for the message).
        names: what to call each member in a message (e.g. ``"at 10.0.0.2:4312"``), by rank; or a function
            that reads them, called only for a message.
        device: where the tensors go (default CPU).

    Raises:
        GroupProofError: a member's proof was wrong or the exchange failed (naming the members).
    """
    describe = _describer(names)
    device = device or torch.device("cpu")
    nonce = torch.tensor(list(os.urandom(NONCE_BYTES)), dtype=torch.uint8, device=device)
    nonces = _exchange(all_gather, nonce, rank, size, timeout, describe, "nonces")
    seen = b"".join(nonces)
    mine = torch.tensor(list(tag(secret, _PURPOSE, context, size, rank, seen)), dtype=torch.uint8, device=device)
    tags = _exchange(all_gather, mine, rank, size, timeout, describe, "proofs")
    failed = [
        member
        for member in range(size)
        if member != rank and not hmac.compare_digest(tags[member], tag(secret, _PURPOSE, context, size, member, seen))
    ]
    if failed:
        names = describe()
        raise GroupProofError(
            f"{_members(failed, names)} of this process group could not prove that "
            f"{'it holds' if len(failed) == 1 else 'they hold'} the job secret ({secret_source()}): "
            f"{'its proof does' if len(failed) == 1 else 'their proofs do'} not match. The group was torn down before "
            "any of the job's data moved through it. Either a program outside the job took a place in the group, or "
            f"a process of the job was given another secret: give every process of the job the same one; see {GUIDE}",
            {member: names.get(member, "") for member in failed},
        )


def proof_timeout() -> float:
    """``DDPKIT_PROOF_TIMEOUT`` (seconds), else :data:`PROOF_TIMEOUT_S`.

    Raises:
        ValueError: the variable is not a positive number (naming its value).
    """
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return PROOF_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(
            f"{TIMEOUT_VARIABLE}={text!r} must be a number of seconds above 0 (default {PROOF_TIMEOUT_S:g})"
        )
    return value


def _exchange(
    all_gather: Callable[[torch.Tensor], list[torch.Tensor]],
    value: torch.Tensor,
    rank: int,
    size: int,
    timeout: float,
    describe: Callable[[], dict[int, str]],
    what: str,
) -> list[bytes]:
    """Every member's ``value`` (fixed-size bytes), all-gathered."""
    try:
        gathered = all_gather(value)
    except Exception as exc:
        others = [member for member in range(size) if member != rank]
        names = describe()
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise GroupProofError(
            f"the members of this process group did not all prove that they hold the job secret "
            f"({secret_source()}): the exchange of {what} with {_members(others, names)} failed or took "
            f"more than {timeout:g} s ({first_line}). The group was torn down before any of the job's data moved "
            "through it. Either a program outside the job took a place in the group, or a member runs without the "
            f"secret or without ddpkit's set-up: give every process of the job the same secret; see {GUIDE}",
            {member: names.get(member, "") for member in others},
        ) from None
    if len(gathered) != size or any(item.shape != value.shape for item in gathered):
        raise GroupProofError(f"the exchange of {what} returned {len(gathered)} values for {size} members", {})
    return [bytes(item.cpu().tolist()) for item in gathered]


def _describer(names: Mapping[int, str] | Callable[[], Mapping[int, str]] | None) -> Callable[[], dict[int, str]]:
    """A function giving what to call each member (``{}`` where reading that fails: a message must not)."""

    def describe() -> dict[int, str]:
        try:
            return dict(names() if callable(names) else names or {})
        except Exception:
            return {}

    return describe


def _timeout_of(group: dist.ProcessGroup | None) -> timedelta | None:
    """The group's own timeout, to restore after the proof (``None`` where the backend does not say)."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        device = torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
        found = pg._get_backend(device).options._timeout
    except Exception:  # another backend, or another torch
        return None
    return found if isinstance(found, timedelta) else None


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _members(ranks: list[int], names: dict[int, str]) -> str:
    named = [f"{member} ({names[member]})" if names.get(member) else str(member) for member in ranks]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(named)


def _addresses_now(addresses: Callable[[], dict[int, str]] | None) -> dict[int, str]:
    try:
        return addresses() if addresses is not None else {}
    except Exception:  # the message must not fail for want of an address
        return {}


def gloo_addresses(group: dist.ProcessGroup | None = None) -> dict[int, str]:
    """``{rank in the group: "HOST:PORT"}``: where each member of a gloo ``group`` said it listens, as gloo wrote it
    in the default group's store when the group was made (``{}`` where that cannot be read).

    This is what the other members connected to, so for a member that is not
    who it should be, it is the address of whoever took its place.
    """
    try:
        store: Any = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):
            store = store.underlying_store
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
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
    """The socket address in a store value that holds a member's gloo address, signed (the digest first: with
    another secret) or not (a stranger's own); ``""`` when none is found."""
    return gloo_address(raw[DIGEST_BYTES:]) or gloo_address(raw)


class SignedStore(dist.Store):  # type: ignore[misc, name-defined]  # torch does not type it
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
        super().__init__()
        self._inner, self._secret, self._context = inner, secret, context
        self._name_key = name_key or (lambda key: f"the value of the key {key!r}")
        self._clones: list[SignedStore] = []

    def clone(self) -> SignedStore:
        """The same store on a connection of its own (as torch's ``Store.clone``). The clone is kept alive with
        this store: torch's stores that clone through this one hold only its C++ part, which needs it."""
        clone = SignedStore(self._inner.clone(), self._secret, self._context, self._name_key)
        self._clones.append(clone)
        return clone

    def _tag(self, key: str, value: bytes) -> bytes:
        return tag(self._secret, _STORE_PURPOSE, self._context, key, value)

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, self._tag(key, data) + data)

    def get(self, key: str) -> bytes:
        raw = bytes(self._inner.get(key))
        signature, value = raw[:DIGEST_BYTES], raw[DIGEST_BYTES:]
        if not hmac.compare_digest(signature, self._tag(key, value)):
            name = self._name_key(key)
            # An address: where it would have sent the group (signed with another secret, or a stranger's own).
            pointed = member_address(raw) if "address" in name else ""
            raise GroupProofError(
                f"{name} in the group's store{f' (it points to {pointed})' if pointed else ''} was not written by a "
                f"process that holds the job secret ({secret_source()}): a program that reached the store put its "
                "own there, or that member runs with another secret. The group was not made; nothing of the job's "
                f"data moved. Give every process of the job the same secret, and keep the job's ports where only "
                f"the job reaches them; see {GUIDE}"
            )
        return value

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

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)

    @property
    def timeout(self) -> timedelta:
        return self._inner.timeout  # type: ignore[no-any-return]
