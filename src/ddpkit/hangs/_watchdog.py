"""The hang watchdog: a thread in every worker that turns a collective stuck past its deadline into a report.

Built on torch's flight recorder (``TORCH_FR_BUFFER_SIZE``), which records every
collective of every process group, ddpkit's, the user's raw
``torch.distributed`` calls and DDP's gradient all-reduce alike: sequence
number, op, shapes, dtypes, the Python stack of the call, and whether it is
still in flight. Every tenth of the deadline (at most 5 s) the watchdog reads
its own in-flight collectives; one older than the deadline means the job
hangs. Then, through a second connection to the process group's store:

1. the first rank to notice becomes the leader and sets a trigger;
2. every rank's watchdog answers with its latest collective per group and the
   Python stack of every thread (and of its forked DataLoader workers);
3. the leader compares them (:mod:`ddpkit.hangs._report`), writes the full
   report to a file, leaves a failure record for the launcher, prints the
   summary, and every rank ends its process (exit code 1), so the job stops
   instead of waiting for the process-group timeout.

A rank that spins in Python or waits in C code still answers (the thread gets
the GIL between bytecodes, or the GIL is released); one stuck in C code that
holds the GIL cannot, and the report says so. :func:`paused` keeps known long
waits (rank 0 writing a checkpoint while the others wait) from counting.

Anyone who reaches the store can write to it and read it. With a job secret the
trigger, the answers and the leader's "done" go through
:class:`~ddpkit._trust.sealed.SealedKeys`: a trigger the job did not sign is ignored
(it cannot end the job), and the answers (host names, pids, stacks) are
encrypted, so a stranger who reads the store learns nothing from them. The
leader is whoever sets the trigger first (a compare-and-set), not a counter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit._compat import override
from ddpkit._failures import FAILURE_DIR_VARIABLE, write_hang_record
from ddpkit._orphans import children_die_with_this_process
from ddpkit._torch_private import default_store, private
from ddpkit._trust.group_store import default_group_context
from ddpkit._trust.sealed import SealedKeys
from ddpkit._trust.secret import job_secret
from ddpkit.hangs._report import analyse, full_report, summary
from ddpkit.hangs._stacks import children_stacks, dump_stacks_in_forked_children, kill_children, thread_stacks
from ddpkit.hangs._state import GroupState, RankState, model_position

__all__ = [
    "DEFAULT_TIMEOUT",
    "REPORT_DIR_VARIABLE",
    "TIMEOUT_VARIABLE",
    "count_own_collectives",
    "enable_flight_recorder",
    "hang_timeout",
    "paused",
    "start_watchdog",
    "stop_watchdog",
]

log = logging.getLogger(__name__)

#: Seconds a rank may wait in one collective before the job counts as hung (5 minutes; see docs/hangs.md).
DEFAULT_TIMEOUT = 300.0
#: Environment variable holding the deadline in seconds for the workers of a job (``0`` or ``off``: no watchdog).
TIMEOUT_VARIABLE = "DDPKIT_HANG_TIMEOUT"
#: Environment variable naming the directory for hang reports (default: the system's temporary directory).
REPORT_DIR_VARIABLE = "DDPKIT_HANG_REPORT_DIR"
_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_RECORDER_ENTRIES = "256"
_KEYS = "ddpkit/hang/"
#: Seconds the leader waits for every rank's answer, and the others for the leader's report.
_ANSWER_WINDOW = 5.0

_current: Watchdog | None = None
_pauses = 0
_lock = threading.Lock()
#: Per process group (by name): the collectives ddpkit itself ran on it before the user's first (the group
#: proof), which the report does not count, so that it numbers the user's collectives from 1.
_own_collectives: dict[str, int] = {}


def count_own_collectives(group_name: str, count: int) -> None:
    """Say that ddpkit ran ``count`` collectives of its own on the group ``group_name`` before the user's first."""
    _own_collectives[group_name] = count


def enable_flight_recorder() -> None:
    """Turn on torch's flight recorder for the process groups created from now on, unless its size is set."""
    if not any(os.environ.get(name) for name in _RECORDER_VARIABLES):
        os.environ["TORCH_FR_BUFFER_SIZE"] = _RECORDER_ENTRIES


def hang_timeout(explicit: float | None = None) -> float | None:
    """The deadline in seconds: ``explicit``, else ``DDPKIT_HANG_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`;
    ``None`` when the watchdog is off (``0``, ``off`` or infinity).

    Raises:
        ValueError: a negative or unreadable value (naming it).
    """
    if explicit is None:
        raw = os.environ.get(TIMEOUT_VARIABLE, "").strip()
        if raw.lower() in ("off", "none", "false"):
            return None
        try:
            explicit = float(raw) if raw else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"{TIMEOUT_VARIABLE}={raw!r} is not a number of seconds (or 'off')") from None
    if explicit < 0 or explicit != explicit:
        raise ValueError(f"the hang timeout must be a number of seconds >= 0 (0 turns it off), got {explicit!r}")
    return None if explicit == 0 or explicit == float("inf") else float(explicit)


def start_watchdog(timeout: float | None = None, *, wait_for_group: bool = False, context: str | None = None) -> None:
    """Watch this process's collectives (once per process; a no-op when it runs already or the deadline is off).

    Args:
        timeout: the deadline in seconds (see :func:`hang_timeout`).
        wait_for_group: start before the default process group exists and attach
            when it appears (a script that calls ``init_process_group`` itself).
        context: what the default group is, for the signatures of the watchdog's keys (the text its members
            proved the secret for); default: :func:`~ddpkit._trust.group_store.default_group_context` of
            ``MASTER_ADDR`` and ``MASTER_PORT``.
    """
    global _current
    deadline = hang_timeout(timeout)
    if deadline is None or not _recorder_available():
        return
    with _lock:
        if _current is not None and _current.is_alive():
            return
        _current = Watchdog(deadline, wait_for_group=wait_for_group, context=context)
        dump_stacks_in_forked_children()  # now, in this thread: before any DataLoader forks its workers
        children_die_with_this_process()  # a hung rank's forked workers must not outlive it
        _current.start()


def stop_watchdog() -> None:
    """Stop this process's watchdog (before its process group is destroyed)."""
    global _current
    with _lock:
        watchdog, _current = _current, None
    if watchdog is not None:
        watchdog.stop()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within this block a long wait in a collective does not count as a hang on this rank (the watchdog still
    answers another rank's report)."""
    global _pauses
    with _lock:
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1


class Watchdog(threading.Thread):
    """One process's watchdog thread (see the module docstring)."""

    def __init__(self, timeout: float, *, wait_for_group: bool = False, context: str | None = None) -> None:
        super().__init__(name="ddpkit-hang-watchdog", daemon=True)
        self.timeout = timeout
        self.tick = min(5.0, max(0.1, timeout / 10))  # seconds between checks: within 10% of the deadline
        self.wait_for_group = wait_for_group
        self._context = context
        self._stopped = threading.Event()
        self._keys: SealedKeys = SealedKeys(None, None, "")
        self._rank = 0
        self._world_size = 1

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=2 * self.tick + 1)

    @override
    def run(self) -> None:
        try:
            if not self._attach():
                return
            while not self._stopped.wait(self.tick):
                if not dist.is_initialized():
                    return
                if self._keys.read(_KEYS + "trigger") is not None:  # one the job wrote: a stranger's is ignored
                    with contextlib.suppress(Exception):
                        self._answer()
                    self._end(leader=False)  # whatever happened: the job is hung
                if _pauses == 0 and self._oldest_wait() > self.timeout:
                    self._lead()
        except Exception as exc:  # the store or the group went away: the job is ending anyway
            log.debug("hang watchdog stopped: %s", exc)

    # --- set-up ------------------------------------------------------------------------------------

    def _attach(self) -> bool:
        while not dist.is_initialized():
            if not self.wait_for_group or self._stopped.wait(0.2):
                return False
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        store = default_store()
        with contextlib.suppress(RuntimeError, AttributeError):
            store = store.clone()  # its own connection: never queued behind the main thread's calls
        context = self._context if self._context is not None else default_group_context()
        self._keys = SealedKeys(store, job_secret(), context)
        return True

    # --- detection ---------------------------------------------------------------------------------

    def _oldest_wait(self) -> float:
        """Seconds this rank has been in its oldest in-flight collective (0 when in none)."""
        entries = json.loads(_dump_json(only_active=True)).get("entries", [])
        created = [int(e["time_created_ns"]) for e in entries if not e.get("retired") and not e.get("is_p2p")]
        return (time.time_ns() - min(created)) / 1e9 if created else 0.0

    # --- the report --------------------------------------------------------------------------------

    def _lead(self) -> None:
        if self._keys.claim(_KEYS + "trigger", str(self._rank).encode()) != str(self._rank).encode():
            return  # another rank leads: answer its trigger at the next tick
        self._answer()
        states = self._collect()
        analysis = analyse(states, self._world_size, self.timeout)
        path = _write_report(full_report(analysis))
        text = summary(analysis, path)
        directory = os.environ.get(FAILURE_DIR_VARIABLE)
        if directory:  # the launcher raises it as a HangError
            named = analysis.stragglers or analysis.mismatched or [self._rank]
            write_hang_record(directory, text, analysis.stragglers, analysis.mismatched, path, named[0])
        else:  # a scheduler's task: nobody else will say it
            print(text, file=sys.stderr, flush=True)
        self._keys.put(_KEYS + "done", (path or "-").encode())
        self._end(leader=True)

    def _answer(self) -> None:
        state: RankState = {
            "rank": self._rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "groups": _recorded_groups(),
            "threads": thread_stacks(skip=threading.get_ident()),
            "children": children_stacks(),
        }
        if (position := model_position()) is not None:
            state["model"] = position
        kill_children()  # their stacks are in; the job ends, and no rank exits before every rank answered
        self._keys.put(f"{_KEYS}answer/{self._rank}", json.dumps(state).encode(), private=True)

    def _collect(self) -> dict[int, RankState]:
        keys = [f"{_KEYS}answer/{rank}" for rank in range(self._world_size)]
        deadline = time.monotonic() + _ANSWER_WINDOW
        while time.monotonic() < deadline and not self._keys.store.check(keys):
            time.sleep(0.05)
        states: dict[int, RankState] = {}
        for rank, key in enumerate(keys):
            answer = self._keys.read(key)
            if answer is not None:  # a rank's own, sealed: a stranger's is left out
                states[rank] = json.loads(answer)
        return states

    def _end(self, leader: bool) -> None:
        """Stop this process: the job is hung. The others wait for the leader's report first (or until its store
        goes away with it)."""
        if not leader:
            deadline = time.monotonic() + 2 * _ANSWER_WINDOW
            with contextlib.suppress(Exception):
                while time.monotonic() < deadline and self._keys.read(_KEYS + "done") is None:
                    time.sleep(0.05)
        kill_children()
        sys.stderr.flush()
        os._exit(1)


# --- what this process knows ----------------------------------------------------------------------


def _recorder_available() -> bool:
    try:
        private("flight_recorder_json"), private("flight_recorder")
    except ImportError:
        return False
    return True


def _dump_json(only_active: bool) -> bytes:
    data: bytes = private("flight_recorder_json")(includeCollectives=True, onlyActive=only_active)
    return data


def _recorded_groups() -> dict[str, GroupState]:
    """Per process group: its description, members (when the recorder knows them) and latest collective."""
    dump_fr_trace = private("flight_recorder")
    # Stack traces only when a collective is still waiting: formatting them imports torch._inductor (seconds),
    # which a rank that spins in Python while holding the GIL most of the time would not finish in time.
    dump = pickle.loads(dump_fr_trace(includeCollectives=True, includeStackTraces=False))
    if any(not entry.get("retired", True) for entry in dump.get("entries", [])):
        dump = pickle.loads(dump_fr_trace(includeCollectives=True, includeStackTraces=True))
    configs = dump.get("pg_config", {})
    now = time.time_ns()
    groups: dict[str, GroupState] = {}
    for entry in dump.get("entries", []):
        if entry.get("is_p2p"):
            continue
        name, description = [*entry.get("process_group", ()), "", ""][:2]
        seq = int(entry.get("collective_seq_id", 0)) - _own_collectives.get(name, 0)
        if seq <= 0:
            continue  # ddpkit's own, before the user's first
        group = groups.setdefault(name, {"desc": description or name, "ranks": _members(configs, name, description)})
        if "last" in group and group["last"].get("seq", 0) > seq:
            continue
        group["last"] = {
            "seq": seq,
            "op": entry.get("profiling_name", "?"),
            "sizes": entry.get("input_sizes", []),
            "dtypes": entry.get("input_dtypes", []),
            "active": not entry.get("retired", True),
            "age": (now - int(entry.get("time_created_ns", now))) / 1e9,
            "frames": [[f.get("filename", "?"), f.get("line", 0), f.get("name", "?"), ""] for f in
                       reversed(entry.get("frames", []))],
        }  # fmt: skip
    return groups


def _members(configs: dict[str, Any], name: str, description: str) -> list[int] | None:
    if description == "default_pg":
        return None  # every rank
    config = configs.get(name)
    if not isinstance(config, dict):
        return None
    try:
        ranks = json.loads(str(config.get("ranks", "")))
    except ValueError:
        return None
    return [int(r) for r in ranks] if isinstance(ranks, list) else None


def _write_report(text: str) -> str | None:
    directory = os.environ.get(REPORT_DIR_VARIABLE) or tempfile.gettempdir()
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        descriptor, path = tempfile.mkstemp(prefix=f"ddpkit-hang-{time.strftime('%Y%m%d-%H%M%S')}-",
                                            suffix=".txt", dir=directory)  # fmt: skip
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as exc:
        log.warning("could not write the hang report to %s: %s", directory, exc)
        return None
    return path
