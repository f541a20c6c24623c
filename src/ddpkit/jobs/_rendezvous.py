"""The rendezvous every ddpkit agent joins: torch's own c10d rendezvous, with its state checked before use.

torch's dynamic rendezvous keeps its state in the rendezvous store as a pickle
and every agent ``pickle.loads`` what it reads there, at every keep-alive: any
program that reaches the store's port could make the agents run code of its
choosing. ddpkit registers a rendezvous backend named ``"ddpkit"`` in torch's
handler registry that wraps torch's c10d backend (same store, same keys, same
protocol) and checks each state it hands back:

* the pickle may name only what a rendezvous state is made of (a restricted
  ``pickle.Unpickler.find_class``, as Python's pickle documentation shows), and
  what it builds must have that state's fields and types (``_state_check``);
* with a job secret (``DDPKIT_JOB_SECRET``, or :func:`use_job_secret` from
  ``ddpkit run --secret-file``), everything a node reads from the store to
  form the job is signed with HMAC-SHA256 and checked before use: the state,
  and every key of a round (``MASTER_ADDR``, ``MASTER_PORT``, the assigned
  ranks, ...: ``_round_store.SignedRoundStore``). Each signature binds the job (a
  random job id that the store's host writes first, signed, under
  :func:`job_key`), the run id and, for a key, its round; each state carries
  a counter that only grows, so a replayed older state of this job, or any
  state of an earlier job with the same secret and run id, is refused.

A state or key that fails is refused with :class:`StateRefusedError` (a torch
``RendezvousStateError``) naming the store, the key and the reason; nothing of
it ran or was used.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
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
    RendezvousSettings,
    Token,
)

from ddpkit._trust.group_store import JOB_ID_VARIABLE
from ddpkit._trust.secret import (
    DIGEST_BYTES,
    OLD_SIGNED_MARKS,
    SECRET_VARIABLE,
    SIGNED_MARK,
    SIGNED_VERSION,
    SignatureError,
    job_secret,
    new_job_secret,
    secret_source,
    sign,
    signed_value,
    use_job_secret,
)
from ddpkit.jobs._round_store import SignedRoundStore
from ddpkit.jobs._state_check import RefusalError as _RefusalError
from ddpkit.jobs._state_check import StateRefusedError, check_state

__all__ = [
    "BACKEND",
    "PEER_GRACE_S",
    "SECRET_VARIABLE",
    "CheckedBackend",
    "JobId",
    "SignedRoundStore",
    "StateRefusedError",
    "check_state",
    "claim_job",
    "default_run_id",
    "forget_refusals",
    "job_key",
    "job_secret",
    "last_refusal",
    "register",
    "use_job_secret",
    "warn_without_secret",
]

#: The name of ddpkit's rendezvous backend in torch's registry (``--rdzv-backend``).
BACKEND = "ddpkit"
#: Where the documentation explains what is checked, and how to set the secret.
GUIDE = "the documentation's Security page (docs/security.md)"
#: Seconds an agent waits after its first refusal before it stops (see ``CheckedBackend._refused``).
PEER_GRACE_S = 3.0
# A signed state, a round's key or the job id is in ddpkit's one signed format (``_trust.secret.sign``); a state's
# value is its 8-byte counter, then torch's pickle. What a signed value begins with, and its tag's length: the
# signature's end is at ``len(_SIGNED) + _DIGEST`` (these names are read by tests that take a signed state apart).
_SIGNED = _SIGNED_VALUE = SIGNED_MARK + bytes([SIGNED_VERSION])
_DIGEST = DIGEST_BYTES
#: Scheduler variables that name the job, for a rendezvous id the nodes agree on without being told.
_JOB_ID_VARIABLES = ("SLURM_JOB_ID", "LSB_JOBID", "PBS_JOBID", "FLUX_JOB_ID", "JOB_ID")

_T = TypeVar("_T")
#: The last refusal in this process since :func:`forget_refusals` (what a launch that failed otherwise reports).
_last_refusal: StateRefusedError | None = None
_warned: set[str] = set()


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
        f"`ddpkit run --secret-file PATH`; see {GUIDE}",
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
    """torch's c10d handler over :class:`CheckedBackend`, its rounds' keys signed (what torch's registry calls for
    ``"ddpkit"``)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    inner, store = create_backend(params)
    endpoint = params.endpoint or "(no endpoint)"
    secret = job_secret()
    job = claim_job(store, params.run_id, endpoint, secret) if secret is not None else None
    if job is not None:  # the workers' groups bind it (the hang watchdog's keys of a plain init_process_group)
        os.environ[JOB_ID_VARIABLE] = job.hex()
    backend = CheckedBackend(inner, params.run_id, endpoint, secret, job)
    handler = create_handler(store, backend, params)
    if job is None:
        return handler
    # torch's handler, as torch's parameters made it, whose rounds' stores sign and check every value.
    return _SignedRoundsHandler(
        handler._this_node, handler._settings, handler._backend_name, handler._store, handler._state_holder, backend
    )


class _SignedRoundsHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler whose round stores are :class:`SignedRoundStore` (with a job secret)."""

    def __init__(
        self,
        node: Any,  # torch's _NodeDesc
        settings: RendezvousSettings,
        backend_name: str,
        store: Any,
        state_holder: Any,  # torch's _RendezvousStateHolder
        checked: CheckedBackend,
    ) -> None:
        super().__init__(node, settings, backend_name, store, state_holder)
        self._checked_backend = checked

    def _wrap_store(self, store: Any) -> Any:
        prefix = f"torch.rendezvous.{self._settings.run_id}.{self._state_holder.state.round}/"
        return SignedRoundStore(super()._wrap_store(store), self._checked_backend, prefix, self._settings.max_nodes)


def job_key(run_id: str) -> str:
    """The store key of a job's id (beside torch's ``torch.rendezvous.<run_id>``)."""
    return f"ddpkit.rendezvous.{run_id}.job"


class JobId(bytes):
    """The random id of one job (16 bytes), which every signature of its rendezvous binds."""


def claim_job(store: Any, run_id: str, endpoint: str, secret: bytes, *, first: bool = False) -> JobId:
    """The job's id in ``store``: a fresh one, signed, if none is there yet, else the one there once it verifies.

    The agent that hosts the store calls it with ``first=True`` right after the
    store starts: a job id already there was written by someone else, and is
    refused. The others take the host's.

    Raises:
        StateRefusedError: the id there is not signed with ``secret`` (or,
            with ``first``, is not this agent's).
    """
    key = job_key(run_id)
    fresh = new_job_secret()[:32]
    mine = _seal(secret, "job", run_id, fresh)
    stored = bytes(store.compare_set(key, "", mine))
    where = f"the job id in the store at {endpoint} (key {key})"
    if first and stored != mine:
        raise _refusal(where, "the store is new, yet someone wrote a job id before this agent", endpoint, None)
    try:
        return JobId(_unseal(secret, "job", run_id, stored))
    except _RefusalError as refusal:
        raise _refusal(where, refusal, endpoint, None) from None


def _seal(secret: bytes, purpose: str, label: str, value: bytes) -> bytes:
    return sign(secret, purpose, value, label)


def _unseal(secret: bytes, purpose: str, label: str, stored: bytes, signed_for: str = "another job or round") -> bytes:
    """The value in ``stored`` (:func:`_seal`'s), else :class:`_RefusalError` saying why."""
    try:
        return signed_value(secret, purpose, stored, label)
    except SignatureError as refused:
        if refused.kind == "unsigned":
            raise _RefusalError(f"it is not signed, and this node has a job secret ({_secret_hint()})") from None
        if refused.kind == "version":
            raise _RefusalError(refused.reason) from None
        raise _RefusalError(
            f"its signature does not match this node's job secret ({_secret_hint()}), or it was signed for {signed_for}"
        ) from None


def _secret_hint() -> str:
    """How this node got its secret, and what every node needs."""
    source = secret_source()
    return (
        f"this node's is from {source}; every node needs the same one"
        if source != SECRET_VARIABLE
        else (f"every node needs the same {SECRET_VARIABLE}")
    )


def _refusal(where: str, reason: object, endpoint: str, since: list[float] | None) -> StateRefusedError:
    """The refusal of what is at ``where``, returned once :data:`PEER_GRACE_S` have passed since ``since[0]``.

    The agents read the state about once a second; the first one to refuse
    waits, with its workers still running and its store (if it hosts it)
    still up, so that every other agent reads the same state and says why
    it stops, instead of seeing only its peer go.
    """
    if since is not None:
        now = time.monotonic()
        if not since:
            since.append(now)
        time.sleep(max(0.0, since[0] + PEER_GRACE_S - now))
    global _last_refusal
    _last_refusal = StateRefusedError(
        f"{where} was not written by a rendezvous agent of this job and was refused: {reason}. Nothing of it "
        f"ran. A program that can reach {endpoint} wrote it: firewall the port to the job's nodes, "
        f"and set a job secret on every node ({SECRET_VARIABLE} or `ddpkit run --secret-file`); see {GUIDE}"
    )
    return _last_refusal


class CheckedBackend(RendezvousBackend):
    """torch's c10d rendezvous backend, whose states are checked (and signed, with a secret) on the way.

    With a secret, each state carries a counter one above the last state this
    agent saw; a state whose counter is below the highest this agent has seen
    (a replay) is refused.

    Args:
        inner: torch's ``C10dRendezvousBackend`` over the rendezvous store.
        run_id: the rendezvous id (signed with the state: a state of another job does not verify).
        endpoint: ``HOST:PORT`` of the store, for the refusal's message.
        secret: the job secret, or ``None`` (states checked, not signed).
        job: the job's id (:func:`claim_job`), signed with every state; with a secret only.
    """

    def __init__(
        self, inner: RendezvousBackend, run_id: str, endpoint: str, secret: bytes | None, job: JobId | None = None
    ) -> None:
        self._inner = inner
        self._run_id = run_id
        self._endpoint = endpoint
        self._secret = secret
        self._job = job or JobId()
        self._refused_since: list[float] = []
        self._highest = 0

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
        signed = self._sign(state, self._highest + 1)
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

    def _refused(self, reason: object, key: str | None = None) -> StateRefusedError:
        where = f"the rendezvous state in the store at {self._endpoint} (key torch.rendezvous.{self._run_id})"
        if key is not None:
            where = f"the value of {key} in the store at {self._endpoint}"
        return _refusal(where, reason, self._endpoint, self._refused_since)

    def _sign(self, state: bytes, counter: int) -> bytes:
        if self._secret is None:
            return state
        return _seal(self._secret, "state", f"{self._job.hex()}/{self._run_id}", counter.to_bytes(8, "big") + state)

    def _admit(self, stored: bytes) -> bytes:
        """The pickle inside ``stored`` once it passed; else :class:`StateRefusedError`."""
        try:
            state = self._verified(stored)
            check_state(state)
        except _RefusalError as refusal:
            raise self._refused(refusal) from None
        return state

    def _verified(self, stored: bytes) -> bytes:
        signed = stored.startswith((SIGNED_MARK, *OLD_SIGNED_MARKS))
        if self._secret is None:
            if signed:
                raise _RefusalError(
                    f"it is signed with a job secret and this node has none (set the same {SECRET_VARIABLE} on "
                    "every node, or pass the same `ddpkit run --secret-file`)"
                )
            return stored
        value = _unseal(self._secret, "state", f"{self._job.hex()}/{self._run_id}", stored, "another job")
        counter, state = int.from_bytes(value[:8], "big"), value[8:]
        if counter < self._highest:
            raise _RefusalError(
                f"it is an older state of this job, replayed (its counter is {counter}; this node has read "
                f"{self._highest})"
            )
        self._highest = counter
        return state

    def seal(self, key: str, value: bytes) -> bytes:
        """``value`` of a round's ``key``, signed for this job (see :class:`SignedRoundStore`)."""
        assert self._secret is not None
        return _seal(self._secret, "key", f"{self._job.hex()}/{self._run_id}/{key}", value)

    def unseal(self, key: str, stored: bytes) -> bytes:
        """The value of ``key`` once its signature verified; else :class:`StateRefusedError`."""
        assert self._secret is not None
        try:
            return _unseal(self._secret, "key", f"{self._job.hex()}/{self._run_id}/{key}", stored)
        except _RefusalError as refusal:
            raise self._refused(refusal, key) from None
