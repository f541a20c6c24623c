"""The rendezvous every ddpkit agent joins: torch's own c10d rendezvous, with its state checked before use.

torch's dynamic rendezvous keeps its state in the rendezvous store as a pickle
and every agent ``pickle.loads`` what it reads there, at every keep-alive: any
program that reaches the store's port could make the agents run code of its
choosing. ddpkit registers a rendezvous backend named ``"ddpkit"`` in torch's
handler registry that wraps torch's c10d backend (same store, same keys, same
protocol) and checks each state it hands back:

* the pickle may name only what a rendezvous state is made of (a restricted
  ``pickle.Unpickler.find_class``, as Python's pickle documentation shows), and
  what it builds must have that state's fields and types;
* with a job secret (``DDPKIT_JOB_SECRET``, or :func:`use_job_secret` from
  ``ddpkit run --secret-file``), every state is signed with HMAC-SHA256 over
  the run id and the state, so a process without the secret can neither run
  code nor add a node.

A state that fails is refused with :class:`StateRefusedError` (a torch
``RendezvousStateError``) naming the store and the reason; nothing of it ran.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
    _NodeDesc,
    _RendezvousState,
)

__all__ = [
    "BACKEND",
    "PEER_GRACE_S",
    "SECRET_VARIABLE",
    "CheckedBackend",
    "StateRefusedError",
    "check_state",
    "default_run_id",
    "forget_refusals",
    "job_secret",
    "last_refusal",
    "register",
    "use_job_secret",
    "warn_without_secret",
]

#: The name of ddpkit's rendezvous backend in torch's registry (``--rdzv-backend``).
BACKEND = "ddpkit"
#: The environment variable that holds the job secret.
SECRET_VARIABLE = "DDPKIT_JOB_SECRET"
#: Where the README explains what is checked, and how to set the secret.
README_SECTION = 'the README section "Security"'
#: Seconds an agent waits after its first refusal before it stops (see ``CheckedBackend._refused``).
PEER_GRACE_S = 3.0
#: A signed state starts with this, then the 32-byte HMAC-SHA256, then torch's pickle.
_SIGNED = b"ddpkit-hmac-sha256\0"
_DIGEST = hashlib.sha256().digest_size
#: Larger than any real state (about 100 bytes per node); a bigger one is refused unread.
_MAX_STATE_BYTES = 16 * 2**20
#: What a rendezvous state's pickle names: torch's two classes and the datetimes of its deadlines and heartbeats.
_ALLOWED = {
    (_RendezvousState.__module__, _RendezvousState.__qualname__): _RendezvousState,
    (_NodeDesc.__module__, _NodeDesc.__qualname__): _NodeDesc,
    ("datetime", "datetime"): datetime,
    ("datetime", "timezone"): timezone,
    ("datetime", "timedelta"): timedelta,
}
#: Scheduler variables that name the job, for a rendezvous id the nodes agree on without being told.
_JOB_ID_VARIABLES = ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID", "JOB_ID")

_T = TypeVar("_T")
_secret_override: bytes | None = None
#: The last refusal in this process since :func:`forget_refusals` (what a launch that failed otherwise reports).
_last_refusal: StateRefusedError | None = None
_warned: set[str] = set()


class StateRefusedError(RendezvousStateError):
    """A rendezvous state failed ddpkit's check; it was not unpickled."""


def use_job_secret(secret: bytes | None) -> None:
    """Sign and check this process's rendezvous states with ``secret`` (``None``: back to ``DDPKIT_JOB_SECRET``).

    Raises:
        ValueError: an empty secret.
    """
    global _secret_override
    if secret is not None and not secret.strip():
        raise ValueError("the job secret is empty; put at least 16 random bytes in it (e.g. `openssl rand -hex 32`)")
    _secret_override = secret.strip() if secret is not None else None


def job_secret() -> bytes | None:
    """The job secret: the one given to :func:`use_job_secret`, else ``DDPKIT_JOB_SECRET``, else ``None``."""
    if _secret_override is not None:
        return _secret_override
    value = os.environ.get(SECRET_VARIABLE, "").strip()
    return value.encode() if value else None


def default_run_id() -> str | None:
    """A rendezvous id from the scheduler's job id (``ddpkit-<id>``: the same on every node of the job), or ``None``."""
    for name in _JOB_ID_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value:
            return f"ddpkit-{value}"
    return None


def warn_without_secret(endpoint: str) -> None:
    """Warn once per endpoint that a multi-node rendezvous has no job secret."""
    if job_secret() is not None or endpoint in _warned:
        return
    _warned.add(endpoint)
    port = endpoint.rpartition(":")[2]
    warnings.warn(
        f"this multi-node job has no job secret: any program that reaches the rendezvous store at {endpoint} "
        f"(port {port}) can add a node to the job or disrupt it (it cannot make the agents run code: ddpkit checks "
        f"every rendezvous state). Set {SECRET_VARIABLE} to the same random value on every node, or pass "
        f"`ddpkit run --secret-file PATH`; see {README_SECTION}",
        UserWarning,
        stacklevel=4,
    )


def last_refusal() -> StateRefusedError | None:
    """The last state this process refused since :func:`forget_refusals`, or ``None``.

    Once one agent refuses a state, the others may first see its workers or
    its store go: a launch that fails after a refusal reports the refusal.
    """
    return _last_refusal


def forget_refusals() -> None:
    """Start a launch with no refusal on record."""
    global _last_refusal
    _last_refusal = None


def register() -> None:
    """Register the ``"ddpkit"`` rendezvous backend in torch's handler registry (again: a no-op)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)


def _create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """torch's c10d handler over :class:`CheckedBackend` (what torch's registry calls for ``"ddpkit"``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    inner, store = create_backend(params)
    endpoint = params.endpoint or "(no endpoint)"
    return create_handler(store, CheckedBackend(inner, params.run_id, endpoint, job_secret()), params)


class CheckedBackend(RendezvousBackend):
    """torch's c10d rendezvous backend, whose states are checked (and signed, with a secret) on the way.

    Args:
        inner: torch's ``C10dRendezvousBackend`` over the rendezvous store.
        run_id: the rendezvous id (signed with the state: a state of another job does not verify).
        endpoint: ``HOST:PORT`` of the store, for the refusal's message.
        secret: the job secret, or ``None`` (states checked, not signed).
    """

    def __init__(self, inner: RendezvousBackend, run_id: str, endpoint: str, secret: bytes | None) -> None:
        self._inner = inner
        self._run_id = run_id
        self._endpoint = endpoint
        self._secret = secret
        self._refused_since: float | None = None

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        result = self._read(self._inner.get_state)
        if result is None:
            return None
        state, token = result
        return self._admit(state), token

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        signed = self._sign(state)
        result = self._read(lambda: self._inner.set_state(signed, token))
        if result is None:
            return None
        current, new_token, written = result
        return self._admit(current), new_token, written

    def _read(self, call: Callable[[], _T]) -> _T:
        """``call()``, with torch's error for a value that is not base64 turned into the refusal."""
        try:
            return call()
        except RendezvousStateError as exc:
            raise self._refused(f"it is not base64 text ({exc.__cause__ or exc})") from None
        except RendezvousConnectionError:
            if _last_refusal is not None:  # the store went with an agent that refused the state first
                raise _last_refusal from None
            raise

    def _refused(self, reason: object) -> StateRefusedError:
        """The refusal, returned once :data:`PEER_GRACE_S` have passed since this backend's first one.

        The agents read the state about once a second; the first one to refuse
        waits, with its workers still running and its store (if it hosts it)
        still up, so that every other agent reads the same state and says why
        it stops, instead of seeing only its peer go.
        """
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        time.sleep(max(0.0, self._refused_since + PEER_GRACE_S - now))
        global _last_refusal
        _last_refusal = StateRefusedError(
            f"the rendezvous state in the store at {self._endpoint} (key torch.rendezvous.{self._run_id}) was "
            f"not written by a rendezvous agent of this job and was refused: {reason}. Nothing of it ran. A "
            f"program that can reach {self._endpoint} wrote it: firewall the port to the job's nodes, and set a "
            f"job secret on every node ({SECRET_VARIABLE} or `ddpkit run --secret-file`); see {README_SECTION}"
        )
        return _last_refusal

    def _sign(self, state: bytes) -> bytes:
        if self._secret is None:
            return state
        return _SIGNED + self._digest(state) + state

    def _digest(self, state: bytes) -> bytes:
        assert self._secret is not None
        return hmac.new(self._secret, self._run_id.encode() + b"\0" + state, hashlib.sha256).digest()

    def _admit(self, stored: bytes) -> bytes:
        """The pickle inside ``stored`` once it passed; else :class:`StateRefusedError`."""
        try:
            state = self._verified(stored)
            check_state(state)
        except _RefusalError as refusal:
            raise self._refused(refusal) from None
        return state

    def _verified(self, stored: bytes) -> bytes:
        signed = stored.startswith(_SIGNED)
        if self._secret is None:
            if signed:
                raise _RefusalError(
                    f"it is signed with a job secret and this node has none (set the same {SECRET_VARIABLE} on "
                    "every node)"
                )
            return stored
        if not signed:
            raise _RefusalError(
                f"it is not signed, and this node has a job secret (every node needs the same {SECRET_VARIABLE})"
            )
        tag, state = stored[len(_SIGNED) : len(_SIGNED) + _DIGEST], stored[len(_SIGNED) + _DIGEST :]
        if not hmac.compare_digest(tag, self._digest(state)):
            raise _RefusalError("its signature does not match this node's job secret")
        return state


class _RefusalError(Exception):
    """Why a state was refused (internal)."""


class _StateUnpickler(pickle.Unpickler):
    """Builds only what a rendezvous state is made of; any other name ends the load before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise _RefusalError(f"it names {module}.{name}, which a rendezvous state never contains")
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise _RefusalError("it holds a persistent id, which a rendezvous state never contains")


def check_state(state: bytes) -> None:
    """Raise ``_RefusalError`` unless ``state`` is a pickle of torch's rendezvous state and nothing else.

    The pickle is loaded with only the state's own classes and datetimes
    importable, then every field's type is checked (a state that would crash
    the agents later, e.g. an ``int`` where a flag belongs, is refused too).
    """
    if len(state) > _MAX_STATE_BYTES:
        raise _RefusalError(f"it is {len(state)} bytes, more than any rendezvous state ({_MAX_STATE_BYTES})")
    try:
        loaded = _StateUnpickler(io.BytesIO(state)).load()
    except _RefusalError:
        raise
    except Exception as exc:  # truncated, garbage, a call with wrong arguments, ...
        raise _RefusalError(f"it is not a valid pickle ({type(exc).__name__}: {exc})") from None
    problem = _shape_problem(loaded)
    if problem:
        raise _RefusalError(f"it is not a rendezvous state ({problem})")


_FIELDS = frozenset(vars(_RendezvousState()))
_NODE_FIELDS = frozenset(("addr", "pid", "local_id"))


def _shape_problem(loaded: Any) -> str | None:
    if type(loaded) is not _RendezvousState:
        return f"a {type(loaded).__name__}"
    fields = vars(loaded)
    if set(fields) != _FIELDS:
        return f"fields {sorted(fields)}"
    checks: list[tuple[str, bool]] = [
        ("round", _is_int(fields["round"])),
        ("complete", type(fields["complete"]) is bool),
        ("closed", type(fields["closed"]) is bool),
        ("deadline", fields["deadline"] is None or _is_time(fields["deadline"])),
        ("participants", _is_map(fields["participants"], _is_int)),
        ("wait_list", _is_set(fields["wait_list"])),
        ("redundancy_list", _is_set(fields["redundancy_list"])),
        ("last_heartbeats", _is_map(fields["last_heartbeats"], _is_time)),
    ]
    bad = [name for name, ok in checks if not ok]
    return f"bad {', '.join(bad)}" if bad else None


def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_time(value: Any) -> bool:
    return type(value) is datetime and value.tzinfo is not None


def _is_node(value: Any) -> bool:
    if type(value) is not _NodeDesc or set(vars(value)) != _NODE_FIELDS:
        return False
    return type(value.addr) is str and _is_int(value.pid) and _is_int(value.local_id)


def _is_set(value: Any) -> bool:
    return type(value) is set and all(_is_node(node) for node in value)


def _is_map(value: Any, is_value: Any) -> bool:
    return type(value) is dict and all(_is_node(node) and is_value(item) for node, item in value.items())
