"""How a replica group builds torchft's ``Manager``: its server on one address, its client recording each quorum
(and asking again for one that did not form in time), its group's store signed.

torchft's ``Manager.__init__`` builds these itself (its server bound to ``[::]``, every interface); ddpkit swaps the
classes it builds for the one construction, under :data:`_CONSTRUCTION`, which keeps two constructions apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ddpkit._trust.group_store import SignedStore
from ddpkit.fault_tolerance._quorums import JobEnded, Verdict
from ddpkit.fault_tolerance._torchft import bracketed

__all__ = ["QUORUM_ATTEMPTS", "SeenQuorum", "client_recording", "manager_server_on", "signed_group_store"]

log = logging.getLogger(__name__)
_CONSTRUCTION = threading.Lock()


@contextmanager
def manager_server_on(managers: Any, address: str) -> Iterator[None]:
    """Within the block, torchft's ``Manager`` builds its server bound to ``address`` (on the port it chose:
    ``TORCHFT_MANAGER_PORT``, else a free one). Under :data:`_CONSTRUCTION` from before torchft's class is read:
    a block that read it while another's replacement was in place would put that one back for good."""
    with _CONSTRUCTION:
        original = managers.ManagerServer

        def bound(*args: Any, **kwargs: Any) -> Any:
            port = str(kwargs.get("bind", ":0")).rpartition(":")[2] or "0"
            return original(*args, **{**kwargs, "bind": f"{bracketed(address)}:{port}"})

        managers.ManagerServer = bound
        try:
            yield
        finally:
            managers.ManagerServer = original


@contextmanager
def signed_group_store(managers: Any, secret: bytes | None, context: str, made: list[SignedStore]) -> Iterator[None]:
    """Within the block (under :data:`_CONSTRUCTION`), torchft's ``Manager`` reaches the group's store through a
    :class:`~ddpkit._trust.group_store.SignedStore` for ``context`` (appended to ``made``) when there is a secret: the
    manager server's address and the group's replica id that its rank 0 writes there, and every rank reads, are
    signed, so that nobody who reaches the store can point the group's ranks to a manager of its own."""
    if secret is None:
        yield
        return
    original = managers.TCPStore

    def signed(*args: Any, **kwargs: Any) -> SignedStore:
        store = SignedStore(original(*args, **kwargs), secret, context, lambda key: f"the group's {key!r}")
        made.append(store)
        return store

    managers.TCPStore = signed
    try:
        yield
    finally:
        managers.TCPStore = original


#: How many times a group asks for one step's quorum when none forms within ``quorum_timeout``.
QUORUM_ATTEMPTS = 3
#: Seconds between a quorum that must not train and the group's next request.
AGAIN_S = 0.1

#: A group's verdict on each quorum it receives (:class:`~ddpkit.fault_tolerance._quorums.QuorumVerdicts`).
Verdicts = Callable[[Any], Verdict]


@dataclass
class SeenQuorum:
    """The last quorum a group's client received and took: its members (torchft's ``NAME:uuid``, in its order) and
    its highest step (the step its members train from)."""

    ids: list[str] = field(default_factory=list)
    max_step: int = 0


class _RecordingClient:
    """torchft's ``ManagerClient``, keeping the replica ids of each quorum it receives (torchft's manager keeps
    them to itself) in ``seen``; judging each quorum (``verdicts``) before torchft sets it up: one that must not
    train is asked again (after :data:`AGAIN_S`), and one that ends the group raises
    :class:`~ddpkit.fault_tolerance._quorums.JobEnded` (from torchft's quorum future: where the group waits for
    the quorum); and asking again (up to :data:`QUORUM_ATTEMPTS` times) when no quorum formed within its
    timeout: torchft's manager would raise that from the next step's ``start_quorum`` and the group's process
    would end (seen while a stranger spoke in a group's name and the quorums were slow to form)."""

    def __init__(self, client: Any, seen: SeenQuorum, replica_id: str, verdicts: Verdicts) -> None:
        self._client, self._seen, self._replica_id, self._verdicts = client, seen, replica_id, verdicts

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        while True:
            quorum = self._ask(*args, **kwargs)
            verdict = self._verdicts(quorum)
            if verdict.kind == "accept":
                break
            if verdict.kind == "end":
                raise JobEnded(verdict.status, verdict.why)
            time.sleep(AGAIN_S)
        self._seen.ids[:] = list(quorum.replica_ids)
        self._seen.max_step = int(quorum.max_step)
        return quorum

    def _ask(self, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, QUORUM_ATTEMPTS + 1):
            try:
                quorum = self._client._quorum(*args, **kwargs)
                break
            except TimeoutError as error:
                if attempt == QUORUM_ATTEMPTS:
                    raise
                log.warning(
                    "replica group %s: no quorum formed within quorum_timeout (%s); asking again (%d of %d)",
                    self._replica_id, str(error).splitlines()[0] if str(error) else "TimeoutError", attempt + 1,
                    QUORUM_ATTEMPTS,
                )  # fmt: skip
        return quorum

    def _checkpoint_metadata(self, *args: Any, **kwargs: Any) -> Any:
        return self._client._checkpoint_metadata(*args, **kwargs)

    def should_commit(self, *args: Any, **kwargs: Any) -> Any:
        return self._client.should_commit(*args, **kwargs)


@contextmanager
def client_recording(managers: Any, seen: SeenQuorum, replica_id: str, verdicts: Verdicts) -> Iterator[None]:
    """Within the block (under :data:`_CONSTRUCTION`), torchft's ``Manager`` gets a client that records each quorum
    it takes in ``seen``, judges each quorum with ``verdicts`` (asking again for one that must not train), and asks
    again for a quorum that did not form in time."""
    original = managers.ManagerClient

    def recording(*args: Any, **kwargs: Any) -> _RecordingClient:
        return _RecordingClient(original(*args, **kwargs), seen, replica_id, verdicts)

    managers.ManagerClient = recording
    try:
        yield
    finally:
        managers.ManagerClient = original
