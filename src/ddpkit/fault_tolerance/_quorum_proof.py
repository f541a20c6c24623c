"""The replica groups' process group (torchft's reconfigurable gloo group), whose members prove that they hold
the job secret each time a quorum configures it, before any state or gradient moves through it.

torchft configures the group at the start of every quorum that differs from the last (a group joined or left,
or the last step failed somewhere), then sends a recovering group its state and all-reduces the step's
gradients over it. Here, with a job secret, the addresses the members give each other in the quorum's store
are signed (:class:`ddpkit._trust.group_store.SignedStore`: nobody else can put its own address in place of a
member's), and the configuration ends with :func:`ddpkit._trust.group_proof.check_members` over the new group. When
a member cannot prove itself, the group is aborted and the configuration raises; torchft then fails the step
in this group without sending or receiving any state (the next quorum configures afresh).
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from ddpkit._torch_private import NAMES, gloo_on_device, module_global_swapped, private
from ddpkit._trust.channel import Channel, normal
from ddpkit._trust.group_proof import check_members
from ddpkit._trust.group_store import SignedStore, member_address
from ddpkit._trust.secret import (
    GUIDE,
    SIGNED_HEADER_BYTES,
    SIGNED_MARK,
    SignatureError,
    secret_source,
    sign,
    signed_value,
)
from ddpkit.errors import GroupProofError
from ddpkit.fault_tolerance._torchft import torchft_module
from ddpkit.fault_tolerance._waits import Watched, Within, reap

__all__ = ["OWNER_KEY", "check_store_owner", "claim_store", "proven_gloo"]

#: The key, at the root of a replica group's store, of the record that says whose store it is (signed).
OWNER_KEY = "ddpkit/store-owner"
_OWNER_PURPOSE = "ddpkit quorum store owner v1"

#: The address this thread's gloo group is being made on (``address``), read by :func:`_bound_gloo`.
_BINDING = threading.local()


def proven_gloo(
    secret: bytes | None,
    timeout: float,
    replica_ids: Callable[[], Sequence[str]],
    address: str | None = None,
    member_timeout: float = 3.0,
    doomed: Callable[[int], str | None] | None = None,
) -> Any:
    """torchft's ``ProcessGroupGloo`` whose members prove ``secret`` at every configuration (none without one),
    its gloo device on ``address``, whose set-up waits at most ``member_timeout`` for a member.

    Args:
        secret: the job secret; ``None``: torchft's group as it is.
        timeout: seconds each collective (the proof's two all-gathers included) may take.
        member_timeout: seconds the configuration waits for the quorum's store and for each member's address in
            it (a member that died after it asked for the quorum never writes one): then it fails, and torchft
            fails the step, instead of waiting ``timeout``.
        doomed: asked (with this rank's rank in its replica group) while a collective has waited a second
            (:class:`~ddpkit.fault_tolerance._waits.Watched`): why it cannot complete (a member stopped, or the
            others went on without this group), else ``None``. Then the wait ends with that error, not ``timeout``.
        replica_ids: the replica ids of the quorum being configured (torchft's ``NAME:uuid``), in rank order: every
            signature binds them, and the quorum's store must be one of theirs (:func:`check_store_owner`).
        address: this machine's address that the other groups reach (gloo listens and advertises there, whatever
            ``GLOO_SOCKET_IFNAME`` says: ddpkit pins a one-machine group's default gloo to loopback with it);
            ``None``: gloo's own choice.
    """
    group_class = _proven_class()
    return group_class(timeout=timedelta(seconds=timeout), secret=secret, replica_ids=replica_ids, address=address,
                       member_timeout=min(member_timeout, timeout), doomed=doomed)  # fmt: skip


# torchft's gloo group, to the type checker (torchft is imported only when a group is made).
_TorchftGloo: Any = object


class _Proving(_TorchftGloo):  # type: ignore[misc]
    """What :func:`_proven_class` adds to torchft's gloo group: its members proved at every configuration
    (a mixin before torchft's class, which is imported only when a group is made)."""

    def __init__(self, *, timeout: timedelta, secret: bytes | None, replica_ids: Callable[[], Sequence[str]],
                 address: str | None, member_timeout: float, doomed: Callable[[int], str | None] | None,
                 ) -> None:  # fmt: skip
        super().__init__(timeout=timeout)
        self._secret, self._ids, self._seconds = secret, replica_ids, timeout.total_seconds()
        self._address, self._member_seconds, self._doomed = address, member_timeout, doomed
        self._rank_in_group: int | None = None  # this rank's in its replica group, once configured
        self._forming: tuple[str, Callable[[], dict[int, str]]] = ("", dict)
        self._signed: SignedStore | None = None
        self._within: Within | None = None  # kept: torch holds only its C++ part

    def configure(
        self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
        group_rank: int | None = None, group_world_size: int | None = None, global_ranks: list[int] | None = None,
    ) -> None:  # fmt: skip
        secret, self._rank_in_group = self._secret, group_rank
        if world_size > 1:
            try:  # a store that is gone (its group died) fails at once, not after torch's connect retries
                _store_answers(store_addr, self._member_seconds)
            except Exception:
                self.abort(errored=False)
                raise
        if secret is None or world_size == 1:
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )
            return
        ids = list(self._ids())  # this quorum's, NAME:uuid, read now (the message may come after the next)

        def names() -> dict[int, str]:
            return _names(store_addr, world_size, ids, self._seconds)

        try:  # before anything of this group goes there: the store must be a member's
            check_store_owner(store_addr, ids, secret, self._member_seconds)
        except Exception:
            self.abort(errored=False)
            raise

        def all_gather(value: torch.Tensor) -> list[torch.Tensor]:
            gathered = [torch.empty_like(value) for _ in range(world_size)]
            self.allgather([gathered], [value], private("allgather_options")()).wait(timedelta(seconds=self._seconds))
            return gathered

        # Every member's process id (NAME:uuid, a new uuid each time a group's process starts) binds what is signed
        # to the processes of this quorum: nothing signed before this process started passes here.
        members = ",".join(sorted(ids))
        context = f"torchft quorum|{quorum_id}|{store_addr}|{group_rank}/{group_world_size}|{members}"
        self._forming = (context, names)
        try:
            super().configure(  # gloo's addresses go through a SignedStore (_create_pg)
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )
            listen = self._signed.addresses if self._signed is not None else {}
            check_members(all_gather, rank, world_size, context, secret, timeout=self._seconds, names=names,
                          channel=lambda: Channel(rank, listen) if listen else None)  # fmt: skip
        except Exception:
            self.abort(errored=False)  # nothing of the job moves through this group
            raise  # torchft logs it (once per quorum: a failed step makes the next quorum a new one)

    def abort(self, errored: bool = True) -> None:
        old = self._pg  # torchft's: the group of the last quorum
        super().abort(errored)
        if old is not None:  # kept, then let go of elsewhere: its end waits for a collective still running
            reap(old, time.monotonic() + self._seconds + 5.0)

    def _wrap_work(self, work: Any, opts: object) -> Any:
        if self._doomed is None or self._rank_in_group is None:
            return work
        doomed, rank = self._doomed, int(self._rank_in_group)
        try:
            work.get_future()
        except RuntimeError:  # gloo's send and recv (a recovering group's state) have none: waited as they are
            return work
        return Watched(work, lambda: doomed(rank))

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        if self._secret is not None and world_size > 1:
            context, names = self._forming

            def name_key(key: str) -> str:
                member = int(key.rpartition("/")[2]) if key.rpartition("/")[2].isdigit() else -1
                said = names().get(member)
                return f"the address of rank {member}" + (f" ({said})" if said else "")

            store = SignedStore(store, self._secret, context, name_key)
            self._signed = store  # torch holds only its C++ part, which cannot call its methods alone
        if world_size > 1:  # however many members never write their address, the set-up ends in time
            store = self._within = Within(store, self._member_seconds)
        with _gloo_on(torchft_module("torchft.process_group"), self._address, self._member_seconds):
            return super()._create_pg(store, rank, world_size)


@functools.cache
def _proven_class() -> type[Any]:
    """torchft's ``ProcessGroupGloo`` with :class:`_Proving` before it: its members proved at every configuration."""
    return type("ProvenGloo", (_Proving, torchft_module("torchft.process_group").ProcessGroupGloo), {})


@contextmanager
def _gloo_on(torchft: Any, address: str | None, setup: float) -> Iterator[None]:
    """Within the block, the gloo groups torchft makes in this thread get one device, on ``address`` (``None``:
    gloo's own choice), and wait at most ``setup`` seconds for their members while they are made (their
    collectives then wait as long as torchft asked).

    torchft's module names :func:`_bound_gloo` in place of torch's gloo class while a block is open in any thread,
    and torch's class again once the last one closes (:func:`~ddpkit._torch_private.module_global_swapped`, which
    keeps the original apart: a block that read the class while another's replacement was in place would
    otherwise put the replacement back for good). :func:`_bound_gloo` is torch's class where no block of its own
    thread is open, so two groups of one process made at once each get their own address and set-up time."""
    _BINDING.address, _BINDING.setup = address, setup
    try:
        with module_global_swapped(torchft, NAMES["torchft_gloo_class"].path, _bound_gloo):
            yield
    finally:
        _BINDING.address = _BINDING.setup = None


def _bound_gloo(*args: Any, **kwargs: Any) -> Any:
    """torch's ``ProcessGroupGloo(store, rank, size, timeout)``, its one device on the address of this thread's
    :func:`_gloo_on` block if one is open, made within that block's set-up time, then given ``timeout``."""
    gloo = torch.distributed.ProcessGroupGloo
    setup = getattr(_BINDING, "setup", None)
    if setup is None or kwargs or len(args) != 4 or not isinstance(args[3], timedelta):
        return gloo(*args, **kwargs)
    store, rank, size, timeout = args
    made = gloo_on_device(store, rank, size, getattr(_BINDING, "address", None), min(timeout, timedelta(seconds=setup)))
    made.set_timeout(timeout)
    return made


def _store_answers(store_addr: str, seconds: float) -> None:
    """Connect to the quorum's store (torchft's ``HOST:PORT/prefix``) with a plain socket, within ``seconds``.

    Raises:
        ConnectionError: nothing listens there any more (the group that hosted it died), or it did not answer.
    """
    host, port = _host_and_port(store_addr.partition("/")[0])
    try:
        with socket.create_connection((host, port), timeout=seconds):
            pass
    except OSError as error:
        raise ConnectionError(
            f"the quorum's store at {store_addr.partition('/')[0]} does not answer ({error}): the replica group that "
            "hosted it is gone; this step fails and the next quorum goes on without it"
        ) from None


def _names(store_addr: str, size: int, ids: list[str], timeout: float) -> dict[int, str]:
    """``{rank: "replica group 'ID' at HOST:PORT"}`` from the quorum's replica ids and the addresses gloo wrote
    in the quorum's store (each part left out where it cannot be read)."""
    addresses: dict[int, str] = {}
    try:
        store = torchft_module("torchft.process_group").create_store_client(
            store_addr, timeout=timedelta(seconds=min(timeout, 5.0))
        )
        for rank in range(size):
            if store.check([f"0/{rank}"]):  # a member that never wrote one is named without (and not waited for)
                raw = bytes(store.get(f"0/{rank}"))  # signed (32 bytes first) by a member; a stranger's may not be
                addresses[rank] = member_address(raw)
    except Exception:  # the message goes without addresses
        pass
    names = {}
    for rank in range(size):
        name = ids[rank].rpartition(":")[0] or ids[rank] if rank < len(ids) else ""
        parts = [f"replica group {name!r}" if name and len(ids) == size else ""]
        parts.append(f"at {addresses[rank]}" if addresses.get(rank) else "")
        names[rank] = " ".join(part for part in parts if part)
    return names


def claim_store(address: str, replica_id: str, secret: bytes, timeout: float = 30.0) -> None:
    """Write, in the replica group's own store at ``address`` (``HOST:PORT``), the signed record that it is the
    store of ``replica_id`` (torchft's ``NAME:uuid`` of the group's process), for :func:`check_store_owner`.
    Rank 0 of the group calls it once its manager exists, before the group's first quorum."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host, port = _host_and_port(address)
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    record = sign(secret, _OWNER_PURPOSE, replica_id.encode(), normal(f"[{host}]:{port}"))
    store.set(OWNER_KEY, record)  # type: ignore[arg-type]


def _host_and_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 with or without brackets, as torchft writes it) as its host and port."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def check_store_owner(store_addr: str, replica_ids: Sequence[str], secret: bytes, timeout: float) -> None:
    """Check that the quorum's store (torchft's ``HOST:PORT/prefix``) is the store of one of the quorum's members
    (``replica_ids``, ``NAME:uuid``), as its signed record says (:func:`claim_store`). torchft's lighthouse takes
    a member's store address from whoever speaks in its name; a store that no member of this quorum vouches for
    is refused before anything of this group is written there.

    Raises:
        GroupProofError: the store has no such record, or one for another address or for a process that is not
            in this quorum (naming the store's address).
    """
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    address = store_addr.partition("/")[0]
    host, port = _host_and_port(address)
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=min(timeout, 10.0)))
        raw = bytes(store.get(OWNER_KEY)) if store.check([OWNER_KEY]) else b""
    except Exception as exc:
        raw, why = b"", f"it could not be read ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
    else:
        why = "it says nothing of its owner"
    if raw:
        try:
            owner = signed_value(secret, _OWNER_PURPOSE, raw, normal(f"[{host}]:{port}")).decode(errors="replace")
        except SignatureError as refused:
            claimed = raw[SIGNED_HEADER_BYTES:] if raw.startswith(SIGNED_MARK) else raw
            why = (
                f"its record of its owner ({claimed.decode(errors='replace')!r}) is not signed with this group's "
                "secret for this address: this group runs with another secret than the job's, or the record was "
                "copied from another store" + (f" ({refused.reason})" if refused.kind == "version" else "")
            )
        else:
            if owner in replica_ids:
                return
            why = f"it is the store of {owner!r}, a process that is not in this quorum ({', '.join(replica_ids)})"
    raise GroupProofError(
        f"the quorum's store at {address}, which torchft's lighthouse named, is not the store of a replica group of "
        f"this quorum that holds the job secret ({secret_source()}): {why}. A program that reached the lighthouse "
        "spoke in a group's name (the lighthouse takes a group's store address from whoever asks). Nothing of this "
        f"group went to that store; this step fails and the next quorum goes on without it. Keep the lighthouse's "
        f"port where only the job reaches it; see {GUIDE}"
    )
