"""The job secret: where a process finds it, how strong it is, and HMAC tags bound to what they vouch for
(private).

A job secret is text that every process of a job holds and nobody else does:
``DDPKIT_JOB_SECRET`` in the environment, or a file given to ``ddpkit run
--secret-file`` (read once by that process, then handed to the processes it
starts in their environment, never on a command line). The rendezvous signs
what it writes with it, and every new process group checks with it that each
of its members holds it (:mod:`ddpkit._trust.group_proof`).

Every signed value can be tested offline against a guess, so a secret must be
one nobody can guess: ddpkit refuses one below :data:`MIN_SECRET_BITS` (an
estimate from its alphabet and length, and from how well it compresses), and a
secret file that other users can read (as ssh does for its keys).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import secrets
import stat
import zlib

from ddpkit.errors import JobSecretError

__all__ = [
    "DIGEST_BYTES",
    "GUIDE",
    "MAKE_ONE",
    "MIN_SECRET_BITS",
    "OLD_SIGNED_MARKS",
    "SECRET_VARIABLE",
    "SIGNED_HEADER_BYTES",
    "SIGNED_MARK",
    "SIGNED_VERSION",
    "SignatureError",
    "export_job_secret",
    "job_secret",
    "new_job_secret",
    "read_secret_file",
    "secret_bits",
    "secret_source",
    "sign",
    "signed_value",
    "tag",
    "use_job_secret",
    "write_secret_file",
]

#: Where users read what the job secret protects and how to give it.
GUIDE = "the documentation's Security page (docs/security.md)"
#: The environment variable that holds the job secret.
SECRET_VARIABLE = "DDPKIT_JOB_SECRET"
#: Bytes in a tag (HMAC-SHA256).
DIGEST_BYTES = hashlib.sha256().digest_size
#: What every value ddpkit signs begins with, then :data:`SIGNED_VERSION` (one byte), the tag, the value.
SIGNED_MARK = b"ddpkit-hmac-sha256\0"
#: The signed values' format: a value of another version is refused, naming both (every process of a job must run
#: the same ddpkit).
SIGNED_VERSION = 1
#: Bytes before a signed value's own: the mark, the version byte, the tag.
SIGNED_HEADER_BYTES = len(SIGNED_MARK) + 1 + DIGEST_BYTES
#: How earlier ddpkit releases marked their signed values (three formats), refused as another version's.
OLD_SIGNED_MARKS = (b"ddpkit-hmac-sha256-v2\0", b"ddpkit-signed-value\0", b"ddpkit-signed-key-v1\0")
#: The fewest bits of entropy a job secret may have (32 hex digits, or 16 random bytes).
MIN_SECRET_BITS = 128
#: The command that makes a good secret file, for messages.
MAKE_ONE = "`ddpkit secret PATH` (or `umask 077; openssl rand -hex 32 > PATH`)"

_secret_override: bytes | None = None
_override_source = ""
#: Values of ``DDPKIT_JOB_SECRET`` already found strong enough (read at every signature).
_checked: set[bytes] = set()


def use_job_secret(secret: bytes | None, source: str = "the job secret given to this process") -> None:
    """Use ``secret`` in this process (``None``: back to ``DDPKIT_JOB_SECRET``); ``source`` says where it came from
    in messages (e.g. ``"--secret-file /etc/job.key"``).

    Raises:
        JobSecretError: an empty secret, or one below :data:`MIN_SECRET_BITS` (naming ``source`` and the fix).
    """
    global _secret_override, _override_source
    if secret is not None:
        _check_strength(secret.strip(), source)
    _secret_override = _as_text(secret.strip()) if secret is not None else None
    _override_source = source if secret is not None else ""


def _as_text(secret: bytes) -> bytes:
    """``secret`` as it can travel in an environment variable: itself if it is text, else ``hex:`` and its hex
    digits (the same on every node that read the same file)."""
    try:
        text = secret.decode()
    except UnicodeDecodeError:
        text = "\0"
    return secret if "\0" not in text else b"hex:" + secret.hex().encode()


def job_secret() -> bytes | None:
    """The job secret: the one given to :func:`use_job_secret`, else ``DDPKIT_JOB_SECRET``, else ``None``.

    Raises:
        JobSecretError: ``DDPKIT_JOB_SECRET`` holds a secret below :data:`MIN_SECRET_BITS` (the message says how
            to make a good one).
    """
    if _secret_override is not None:
        return _secret_override
    value = os.environ.get(SECRET_VARIABLE, "").strip()
    if not value:
        return None
    secret = value.encode()
    if secret not in _checked:
        raw = secret
        if secret.startswith(b"hex:"):  # a binary secret file, as _as_text hands it on
            with contextlib.suppress(ValueError):
                raw = bytes.fromhex(secret[4:].decode())
        _check_strength(raw, SECRET_VARIABLE)
        _checked.add(secret)
    return secret


def secret_source() -> str:
    """How this process got its secret, as a user gave it: ``"--secret-file PATH"`` or ``"DDPKIT_JOB_SECRET"``."""
    return _override_source if _secret_override is not None else SECRET_VARIABLE


def new_job_secret() -> bytes:
    """A fresh secret for one job: 32 random bytes, as 64 hex digits (it travels in an environment variable)."""
    return secrets.token_hex(32).encode()


def export_job_secret(environ: dict[str, str] | os._Environ[str]) -> None:
    """Put this process's secret into ``environ`` (the environment of the processes it starts), if it has one."""
    secret = job_secret()
    if secret is not None:
        environ[SECRET_VARIABLE] = secret.decode()


def tag(secret: bytes, purpose: str, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``purpose`` and ``parts`` under ``secret``; each part is length-prefixed, so no two different
    lists of parts give the same message."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (purpose, *parts):
        data = part if isinstance(part, bytes) else str(part).encode()
        mac.update(len(data).to_bytes(8, "big") + data)
    return mac.digest()


def sign(secret: bytes, purpose: str, value: bytes, *bound: bytes | str | int) -> bytes:
    """``value`` signed: :data:`SIGNED_MARK`, the :data:`SIGNED_VERSION` byte, the :func:`tag` of ``purpose``,
    the ``bound`` parts (what the value is for: the job, the group, its key) and ``value``, then ``value``. The one
    format of every signed value ddpkit stores; :func:`signed_value` reads it back."""
    return SIGNED_MARK + bytes([SIGNED_VERSION]) + tag(secret, purpose, *bound, value) + value


class SignatureError(ValueError):
    """A stored value that :func:`signed_value` refused; :attr:`reason` says why, in words for a message
    ("it is not signed", ...), :attr:`kind` as a word: ``"unsigned"``, ``"version"`` or ``"mismatch"``."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


def signed_value(secret: bytes, purpose: str, stored: bytes, *bound: bytes | str | int) -> bytes:
    """The value inside ``stored`` that :func:`sign` made with ``secret``, ``purpose`` and ``bound``.

    Raises:
        SignatureError: ``stored`` is not a signed value (``kind`` "unsigned"), is one of another format (an older
            ddpkit's, or another version byte: "version"), or its tag does not verify ("mismatch": another secret,
            or signed for something else).
    """
    if not stored.startswith(SIGNED_MARK):
        if stored.startswith(OLD_SIGNED_MARKS):
            raise SignatureError(
                "version", "it is signed in an earlier ddpkit's format (before signed values had a version byte): "
                "every process of a job must run the same ddpkit"
            )  # fmt: skip
        raise SignatureError("unsigned", "it is not signed")
    version = stored[len(SIGNED_MARK) : len(SIGNED_MARK) + 1]
    if version != bytes([SIGNED_VERSION]):
        raise SignatureError(
            "version", f"it is signed in format {version[0] if version else '(none)'}, this ddpkit's is "
            f"{SIGNED_VERSION}: every process of a job must run the same ddpkit"
        )  # fmt: skip
    signature, value = stored[len(SIGNED_MARK) + 1 : SIGNED_HEADER_BYTES], stored[SIGNED_HEADER_BYTES:]
    if not hmac.compare_digest(signature, tag(secret, purpose, *bound, value)):
        raise SignatureError("mismatch", "its signature does not match")
    return value


def secret_bits(secret: bytes) -> float:
    """A quick estimate of the bits of entropy in ``secret`` (stripped): the smaller of its length times the
    bits of each symbol of its alphabet (hex digits 4; base64 6; the classes of characters it uses otherwise,
    e.g. lowercase letters log2(26); raw bytes 8; words separated by spaces about 13 bits each, as a
    diceware phrase) and 8 bits per byte of it compressed (repetitions count once). An upper bound: a secret
    that passes may still be guessable (a word with digits), one that fails surely is."""
    if not secret:
        return 0.0
    try:
        text = secret.decode("ascii")
    except UnicodeDecodeError:
        text = ""
    if not text or not text.isprintable():
        by_alphabet = 8.0 * len(secret)
    elif all(c in "0123456789abcdefABCDEF" for c in text):
        by_alphabet = 4.0 * len(text)
    elif " " in text.strip() and all(word.isalpha() for word in text.split()):
        by_alphabet = 12.9 * len(text.split())
    elif _is_base64(text):
        by_alphabet = 6.0 * len(text.rstrip("="))
    else:
        classes = [
            any(c.islower() for c in text) and 26,
            any(c.isupper() for c in text) and 26,
            any(c.isdigit() for c in text) and 10,
            any(not c.isalnum() for c in text) and 33,
        ]
        by_alphabet = len(text) * math.log2(sum(classes))
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    compressed = len(packer.compress(secret) + packer.flush())
    return min(by_alphabet, 8.0 * compressed)


def _is_base64(text: str) -> bool:
    """Whether ``text`` looks like random base64 (either alphabet): only its symbols, and at least two of lowercase,
    uppercase and digits (a random string of it may lack one class; words in one case are not one)."""
    alphabet = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/-_=")
    kinds = sum(any(test(c) for c in text) for test in (str.islower, str.isupper, str.isdigit))
    return set(text) <= alphabet and kinds >= 2


def _check_strength(secret: bytes, source: str) -> None:
    """Raise :class:`JobSecretError` for a secret below :data:`MIN_SECRET_BITS`, naming ``source``."""
    bits = secret_bits(secret)
    if bits >= MIN_SECRET_BITS:
        return
    what = "is empty" if not secret else f"has about {bits:.0f} bits of entropy, which a stranger could guess"
    raise JobSecretError(
        f"the job secret from {source} {what}: every signed value in the job's stores lets anyone who reads it "
        f"test guesses offline, so ddpkit needs at least {MIN_SECRET_BITS} random bits (32 hex digits, or 16 "
        f"random bytes). Make one with {MAKE_ONE}"
    )


def read_secret_file(path: str) -> bytes:
    """The secret in the file at ``path`` (stripped), once it is strong enough and only its owner may read it.

    Raises:
        OSError: the file cannot be read.
        JobSecretError: other users can read or write it (naming its mode and ``chmod 600 PATH``), or the secret
            in it is empty or below :data:`MIN_SECRET_BITS`.
    """
    with open(path, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise JobSecretError(
                f"--secret-file {path}: its permissions {stat.S_IMODE(mode):04o} let other users of this machine "
                f"read it (or write it), so it is no secret from them; make it the owner's alone: `chmod 600 {path}`"
            )
        secret = handle.read().strip()
    _check_strength(secret, f"--secret-file {path}")
    return secret


def write_secret_file(path: str) -> None:
    """Create ``path`` holding a new secret (:func:`new_job_secret`: 64 hex digits), readable by its owner alone.

    Raises:
        FileExistsError: ``path`` exists (it is never overwritten: a job may be using it).
        OSError: the file cannot be created.
    """
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(new_job_secret() + b"\n")
