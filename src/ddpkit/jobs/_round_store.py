"""A rendezvous round's store whose every value is signed with the job secret (``SignedRoundStore``): torch's
agents hand each other ``MASTER_ADDR``, ``MASTER_PORT`` and the ranks through it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ddpkit.jobs._state_check import StateRefusedError

__all__ = ["Seals", "SignedRoundStore"]


class Seals(Protocol):
    """What signs and checks a round's values (``_rendezvous.CheckedBackend``)."""

    def seal(self, key: str, value: bytes) -> bytes: ...

    def unseal(self, key: str, stored: bytes) -> bytes: ...


class SignedRoundStore:
    """A round's store as torch's agent uses it (``MASTER_ADDR``, ``MASTER_PORT``, ranks, barriers), each value
    signed when set and checked when read.

    torch's agents hand each other the process group's address and the ranks
    through plain keys of the round's store; here ``set``/``multi_set`` sign
    and ``get``/``multi_get`` check (a value without this job's signature for
    that round and key is refused), and the rest (``add``, ``wait``, ...) is
    the store's own.

    An agent that refuses a value also writes a signed refusal into each of
    the round's keys that no agent has written yet (``MASTER_ADDR``, the
    ranks, ...), so that the agents waiting on them stop at once and say why,
    instead of waiting for the store's timeout.
    """

    def __init__(self, inner: Any, backend: Seals, prefix: str, nodes: int = 1) -> None:
        self._inner = inner
        self._backend = backend
        self._prefix = prefix
        self._nodes = nodes

    def set(self, key: str, value: str | bytes) -> None:
        self._inner.set(key, self._backend.seal(self._prefix + key, _bytes(value)))

    def get(self, key: str) -> bytes:
        return self._open(key, bytes(self._inner.get(key)))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        sealed = [
            self._backend.seal(self._prefix + key, _bytes(value)) for key, value in zip(keys, values, strict=True)
        ]
        self._inner.multi_set(list(keys), sealed)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        found = self._inner.multi_get(list(keys))
        return [self._open(key, bytes(value)) for key, value in zip(keys, found, strict=True)]

    def _open(self, key: str, stored: bytes) -> bytes:
        try:
            value = self._backend.unseal(self._prefix + key, stored)
        except StateRefusedError as refusal:
            self._tell_the_others(str(refusal))
            raise
        if value.startswith(_PEER_REFUSED):
            raise StateRefusedError(
                f"another agent of this job stopped the rendezvous: {value[len(_PEER_REFUSED) :].decode()}"
            )
        return value

    def _tell_the_others(self, reason: str) -> None:
        """Write the refusal, signed, into every key of this round that the agents wait on and nobody wrote yet."""
        keys = ["MASTER_ADDR", "MASTER_PORT"]
        for node in range(max(self._nodes, 2)):
            keys += [f"torchelastic/role_info/{node}", f"torchelastic/assigned_ranks/{node}"]
        for key in keys:
            try:
                sealed = self._backend.seal(self._prefix + key, _PEER_REFUSED + reason.encode())
                self._inner.compare_set(key, "", sealed)
            except Exception:  # the store is gone: nobody waits on it any more
                return

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


#: What a round's key holds when an agent refused the round: this, then why.
_PEER_REFUSED = b"\0ddpkit-refused\0"


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
