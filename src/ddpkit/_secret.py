"""The job secret: where a process finds it, and HMAC tags bound to what they vouch for (private).

A job secret is text that every process of a job holds and nobody else does:
``DDPKIT_JOB_SECRET`` in the environment, or a file given to ``ddpkit run
--secret-file`` (read once by that process, then handed to the processes it
starts in their environment, never on a command line). The rendezvous signs
what it writes with it, and every new process group checks with it that each
of its members holds it (:mod:`ddpkit._group_proof`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = [
    "DIGEST_BYTES",
    "SECRET_VARIABLE",
    "export_job_secret",
    "job_secret",
    "new_job_secret",
    "secret_source",
    "tag",
    "use_job_secret",
]

#: The environment variable that holds the job secret.
SECRET_VARIABLE = "DDPKIT_JOB_SECRET"
#: Bytes in a tag (HMAC-SHA256).
DIGEST_BYTES = hashlib.sha256().digest_size

_secret_override: bytes | None = None
_override_source = ""


def use_job_secret(secret: bytes | None, source: str = "the job secret given to this process") -> None:
    """Use ``secret`` in this process (``None``: back to ``DDPKIT_JOB_SECRET``); ``source`` says where it came from
    in messages (e.g. ``"--secret-file /etc/job.key"``).

    Raises:
        ValueError: an empty secret.
    """
    global _secret_override, _override_source
    if secret is not None and not secret.strip():
        raise ValueError("the job secret is empty; put at least 16 random bytes in it (e.g. `openssl rand -hex 32`)")
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
    """The job secret: the one given to :func:`use_job_secret`, else ``DDPKIT_JOB_SECRET``, else ``None``."""
    if _secret_override is not None:
        return _secret_override
    value = os.environ.get(SECRET_VARIABLE, "").strip()
    return value.encode() if value else None


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
