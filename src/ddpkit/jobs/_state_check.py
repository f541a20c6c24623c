"""Whether bytes read from the rendezvous store are torch's rendezvous state and nothing else, before torch
unpickles them: a restricted unpickler (only the state's own classes and datetimes) and a check of every field's
type. ``_rendezvous.CheckedBackend`` calls :func:`check_state` on every state it reads."""

from __future__ import annotations

import io
import pickle
from datetime import datetime, timedelta, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from ddpkit._torch_private import private

__all__ = ["RefusalError", "StateRefusedError", "check_state"]

_RendezvousState, _NodeDesc = private("rendezvous_state"), private("rendezvous_node")  # torch's own classes


class StateRefusedError(RendezvousStateError):
    """A rendezvous state failed ddpkit's check; it was not unpickled."""


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


class RefusalError(Exception):
    """Why a state was refused (internal)."""


class _StateUnpickler(pickle.Unpickler):
    """Builds only what a rendezvous state is made of; any other name ends the load before it is imported."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get((module, name))
        if allowed is None:
            raise RefusalError(f"it names {module}.{name}, which a rendezvous state never contains")
        return allowed

    def persistent_load(self, pid: Any) -> Any:
        raise RefusalError("it holds a persistent id, which a rendezvous state never contains")


def check_state(state: bytes) -> None:
    """Raise ``RefusalError`` unless ``state`` is a pickle of torch's rendezvous state and nothing else.

    The pickle is loaded with only the state's own classes and datetimes
    importable, then every field's type is checked (a state that would crash
    the agents later, e.g. an ``int`` where a flag belongs, is refused too).
    """
    if len(state) > _MAX_STATE_BYTES:
        raise RefusalError(f"it is {len(state)} bytes, more than any rendezvous state ({_MAX_STATE_BYTES})")
    try:
        loaded = _StateUnpickler(io.BytesIO(state)).load()
    except RefusalError:
        raise
    except Exception as exc:  # truncated, garbage, a call with wrong arguments, ...
        raise RefusalError(f"it is not a valid pickle ({type(exc).__name__}: {exc})") from None
    problem = _shape_problem(loaded)
    if problem:
        raise RefusalError(f"it is not a rendezvous state ({problem})")


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
