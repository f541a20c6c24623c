"""Keys that the ranks of a group read and act on, in a store that anyone who reaches it can write: signed for the
job, and sealed where what they hold is nobody else's business (private).

A process group's store takes reads and writes from any program that reaches
its port. What ddpkit keeps there besides torch's own keys (the hang
watchdog's trigger and each rank's answer, ``ddpkit doctor``'s findings) goes
through :class:`SealedKeys`: with a job secret, every value is signed with a key
derived from the secret and the group's ``context`` (the job, its attempt and
its store), bound to its key, and a value that does not verify is treated as
absent, so a stranger's write does nothing; a *private* value (a rank's host
name, pid and stacks) is also encrypted, so a stranger who reads the store
learns nothing from it. Without a secret, values are stored as they are.

A signed value is in ddpkit's one signed format (:func:`~ddpkit._trust.secret.sign`: a mark, a version byte,
HMAC-SHA256 over its key's name and the value); a private
one is sealed with ChaCha20-Poly1305 (the ``cryptography`` package's AEAD, RFC
8439) under a fresh random 12-byte nonce, its key's name as associated data.
Both keys are derived with HMAC from the secret and the context. No counter is
used anywhere a count would decide something: a stranger could add to it.
A value sealed by ddpkit 0.2's own cipher (its ``-v1`` prefix) is refused with
a warning: every rank of a job must run the same ddpkit.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ddpkit._trust.secret import SignatureError, sign, signed_value, tag

__all__ = ["SealedKeys"]

log = logging.getLogger(__name__)

_PRIVATE = b"ddpkit-sealed-key-v2\0"
_OLD_PRIVATE = b"ddpkit-sealed-key-v1\0"  # ddpkit 0.2's SHAKE-256 keystream with HMAC: refused
_SIGNED_PURPOSE = "ddpkit group key"
_NONCE_BYTES = 12  # ChaCha20-Poly1305's; random each time (2**-96 a collision)
_said_old = False  # the old format's warning is given once a process (a stranger could write many)


class SealedKeys:
    """A group's own keys in ``store``: values signed (and, when private, encrypted) for ``context`` with
    ``secret``; with ``secret=None``, plain values.

    Every member of the group must use the same ``context``. No method raises for a value that a stranger wrote:
    it reads as absent (and is logged at DEBUG).

    Args:
        store: the store (e.g. a clone of the default group's).
        secret: the job secret, or ``None``.
        context: what the group is, the same text on every member (the job, its attempt, its store).
    """

    def __init__(self, store: Any, secret: bytes | None, context: str) -> None:
        self.store, self._context = store, context
        self._sign_key = tag(secret, "ddpkit group keys: sign", context) if secret is not None else None
        seal_key = tag(secret, "ddpkit group keys: seal", context) if secret is not None else None
        self._seal_key = ChaCha20Poly1305(seal_key) if seal_key is not None else None

    @property
    def signed(self) -> bool:
        """Whether values are signed (the group has a job secret)."""
        return self._sign_key is not None

    def seal(self, key: str, value: bytes, *, private: bool = False) -> bytes:
        """What :meth:`put` stores for ``value`` under ``key``."""
        if self._sign_key is None or self._seal_key is None:
            return value
        if not private:
            return sign(self._sign_key, _SIGNED_PURPOSE, value, key)
        nonce = os.urandom(_NONCE_BYTES)
        return _PRIVATE + nonce + self._seal_key.encrypt(nonce, value, _associated(key))

    def open(self, key: str, stored: bytes) -> bytes | None:
        """The value that :meth:`seal` made for ``key``, or ``None`` when ``stored`` is not one (a stranger's)."""
        if self._sign_key is None or self._seal_key is None:
            return stored
        if stored.startswith(_PRIVATE):
            nonce, sealed = stored[len(_PRIVATE) : len(_PRIVATE) + _NONCE_BYTES], stored[len(_PRIVATE) + _NONCE_BYTES :]
            try:
                return self._seal_key.decrypt(nonce, sealed, _associated(key)) if len(nonce) == _NONCE_BYTES else None
            except InvalidTag:
                return None
        if stored.startswith(_OLD_PRIVATE):
            _say_old_format(key)
            return None
        try:
            return signed_value(self._sign_key, _SIGNED_PURPOSE, stored, key)
        except SignatureError as refused:
            if refused.kind == "version":
                _say_old_format(key, "signed by an earlier ddpkit")
            return None

    def put(self, key: str, value: bytes, *, private: bool = False) -> None:
        """Store ``value`` under ``key``, signed (and encrypted when ``private``)."""
        self.store.set(key, self.seal(key, value, private=private))

    def present(self, key: str) -> bool:
        """Whether anything is stored under ``key`` (it may still be a stranger's: :meth:`read` tells)."""
        return bool(self.store.check([key]))

    def read(self, key: str) -> bytes | None:
        """The value under ``key``, or ``None`` when there is none or it is not the group's."""
        if not self.present(key):
            return None
        try:
            stored = bytes(self.store.get(key))
        except Exception as exc:  # a signed store below refused it, or it went away
            log.debug("the value of %r in the group's store could not be read: %s", key, exc)
            return None
        value = self.open(key, stored)
        if value is None:
            log.debug("the value of %r in the group's store was not written by the group; ignored", key)
        return value

    def claim(self, key: str, value: bytes) -> bytes:
        """Store ``value`` under ``key`` unless a value of the group is there first; the value that is there
        afterwards (``value`` when this call won). A stranger's value there does not count: it is replaced."""
        mine = self.seal(key, value)
        try:
            found = self.open(key, bytes(self.store.compare_set(key, b"", mine)))
        except Exception as exc:  # a signed store below refused what is there
            log.debug("the value of %r in the group's store was not written by the group: %s", key, exc)
            found = None
        if found is not None:
            return found
        self.store.set(key, mine)  # a stranger's value: take the key
        return self.read(key) or value


def _associated(key: str) -> bytes:
    """What a private value is bound to besides its seal key: its key's name (a copy under another key fails)."""
    name = key.encode()
    return b"private" + len(name).to_bytes(8, "big") + name


def _say_old_format(key: str, what: str = "sealed by ddpkit 0.2") -> None:
    global _said_old
    if not _said_old:
        _said_old = True
        log.warning(
            "the value of %r in the group's store was %s (a format no longer read): every rank of a job must run the "
            "same ddpkit version; the value is ignored",
            key,
            what,
        )
