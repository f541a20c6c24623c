"""Every member of a new process group proves that it holds the job secret, over the group's own connections,
before the job's data moves (private).

A challenge and response over the group itself, so that what is proven is who
is at the other end of the group's own connections (not who wrote a key to a
store): each member draws a fresh random nonce, the group all-gathers them,
then each member all-gathers its HMAC tag over the group's context (the job,
the group's id, its attempt, the store it met at), its rank, every nonce and
what it sees of its connections (:mod:`ddpkit._trust.channel`), with that view. Each
member checks every other member's tag, and that the views of every connection
between them agree: a relay on two connections fails on both sides. A member
without the secret cannot make its tag, cannot reuse one made for another
rank, group or job, and learns nothing it could use: only random nonces,
addresses and tags move. A group where any tag or view is wrong, or where the
proof does not finish within :data:`PROOF_TIMEOUT_S`, raises
:class:`~ddpkit.errors.GroupProofError` on every member that holds the secret.

:mod:`ddpkit._trust.group_store` covers what comes before: the addresses the members
give each other in the group's store as the group forms, signed for the group.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from ddpkit._torch_private import group_timeout, set_group_timeout
from ddpkit._trust.channel import Channel
from ddpkit._trust.secret import DIGEST_BYTES, GUIDE, secret_source, tag
from ddpkit.errors import GroupProofError

__all__ = [
    "NONCE_BYTES",
    "PROOF_COLLECTIVES",
    "PROOF_TIMEOUT_S",
    "TIMEOUT_VARIABLE",
    "check_members",
    "proof_timeout",
    "prove_members",
]

#: Seconds a member waits for the others' nonces, then for their tags, unless ``DDPKIT_PROOF_TIMEOUT`` says.
PROOF_TIMEOUT_S = 60.0
#: The environment variable that sets the proof's deadline, in seconds.
TIMEOUT_VARIABLE = "DDPKIT_PROOF_TIMEOUT"
#: Collectives the proof runs on the group (two all-gathers).
PROOF_COLLECTIVES = 2
#: Bytes of each member's random nonce.
NONCE_BYTES = 32
_PURPOSE = "ddpkit group proof v2"


def prove_members(
    group: dist.ProcessGroup | None,
    context: str,
    secret: bytes,
    *,
    timeout: float | None = None,
    addresses: Callable[[], dict[int, str]] | None = None,
    listen: Mapping[int, list[str]] | None = None,
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
        listen: each member's listening addresses by rank, as this member
            read them in the group's signed store (:attr:`SignedStore.addresses`):
            with a gloo group, the proof then also binds each member's view of
            its connections (a relay fails it on both sides).

    Raises:
        GroupProofError: a member's proof was wrong, or the proofs did not
            arrive within ``timeout`` (naming the members and the fix).
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if size == 1:
        return
    timeout = proof_timeout() if timeout is None else timeout
    found = {member: f"at {address}" for member, address in _addresses_now(addresses).items()}
    gloo = "gloo" in str(dist.get_backend(group))
    seeing = Channel(rank, listen) if gloo and listen else None
    device = _device(group)
    restore = _timeout_of(group)
    set_group_timeout(group, timedelta(seconds=timeout))

    def all_gather(value: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(gathered, value, group=group)
        return gathered

    try:
        check_members(all_gather, rank, size, context, secret, timeout=timeout, names=found, device=device,
                      channel=seeing)  # fmt: skip
    finally:  # a refused group keeps its own timeout too, for whatever its caller does with it next
        if restore is not None:
            set_group_timeout(group, restore)


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
    channel: Channel | Callable[[], Channel | None] | None = None,
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
        channel: this member's view of the group's connections (gloo's TCP), or a function that reads it once the
            group is made (``None`` where there is none to bind, e.g. NCCL): each member's proof then also covers
            what it sees of its connections, and the views must agree (see :mod:`ddpkit._trust.channel`), so a relay
            that sits on two connections fails on both sides.

    Raises:
        GroupProofError: a member's proof was wrong, the exchange failed, or a member's view of a connection
            between the two of them is not this member's (a relay: naming the addresses).
    """
    describe = _describer(names)
    device = device or torch.device("cpu")
    seeing = channel() if callable(channel) else channel
    view = seeing.view() if seeing is not None else b""
    # 1: a fresh nonce from every member, with the length of what it sees of the group's connections
    first = os.urandom(NONCE_BYTES) + len(view).to_bytes(8, "big")
    gathered = _exchange(all_gather, torch.tensor(list(first), dtype=torch.uint8, device=device), rank, size, timeout,
                         describe, "nonces")  # fmt: skip
    seen = b"".join(item[:NONCE_BYTES] for item in gathered)
    longest = max(int.from_bytes(item[NONCE_BYTES:], "big") for item in gathered)
    # 2: every member's tag over the group, its rank, every nonce and its view of the connections, with that view
    mine = tag(secret, _PURPOSE, context, size, rank, seen, view) + view.ljust(longest, b"\0")
    said = _exchange(all_gather, torch.tensor(list(mine), dtype=torch.uint8, device=device), rank, size, timeout,
                     describe, "proofs")  # fmt: skip
    views = [
        item[DIGEST_BYTES : DIGEST_BYTES + int.from_bytes(gathered[member][NONCE_BYTES:], "big")]
        for member, item in enumerate(said)
    ]
    failed = [
        member
        for member in range(size)
        if member != rank
        and not hmac.compare_digest(said[member][:DIGEST_BYTES], tag(secret, _PURPOSE, context, size, member, seen,
                                                                     views[member]))
    ]  # fmt: skip
    if not failed and seeing is not None:
        _check_channel(seeing, views, describe)
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


def _check_channel(seeing: Channel, views: list[bytes], describe: Callable[[], dict[int, str]]) -> None:
    """Raise :class:`GroupProofError` when a member's view of the connections (in its proof) does not mirror
    this member's."""
    for member, view in enumerate(views):
        if member == seeing.rank:
            continue
        why = seeing.mismatch(member, view)
        if why is None:
            continue
        names = describe()
        raise GroupProofError(
            f"{_members([member], names)} of this process group proved that it holds the job secret, but not over a "
            f"connection of its own: {why}. The group was torn down before any of the job's data moved through it. "
            "A program between the two relays their connection (it reached them through an address the group's "
            f"store did not give, or controls the network): keep the job's ports where only the job reaches them; "
            f"see {GUIDE}",
            {member: names.get(member, "")},
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
    pg = group if group is not None else dist.group.WORLD
    device = torch.device("cuda") if "nccl" in str(dist.get_backend(group)) else torch.device("cpu")
    return group_timeout(pg, device)


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
