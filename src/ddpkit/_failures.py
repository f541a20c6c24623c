"""Which worker failed first: per-worker failure records and their reading (private).

When one worker raises, it exits, and its peers then fail inside their
collectives with "Connection reset by peer". The elastic agent reports only the
first exited worker its poll happens to see, often a peer, and its error files
carry whole-second timestamps. So every worker started by ddpkit writes its own
record (error, traceback, exact time) into a directory the launcher owns before
it exits; the earliest record is the root cause. On one machine this order is
causal: the failing rank records before it exits, the peers fail after.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from ddpkit.errors import HangError, WorkerFailedError

__all__ = [
    "FAILURE_DIR_VARIABLE",
    "StopWithoutRestart",
    "earliest",
    "hang_record",
    "read_records",
    "stopped_record",
    "worker_failed_error",
    "write_hang_record",
    "write_record",
]

#: Environment variable naming the directory where workers write their failure records.
FAILURE_DIR_VARIABLE = "DDPKIT_FAILURE_DIR"


class StopWithoutRestart(SystemExit):
    """A worker's exit (status 1) that an agent with restarts left must not answer by starting the workers
    again: the job was told to stop (SLURM's warning before the walltime, with the state in a checkpoint).

    A worker of ``ddpkit run`` records it and exits with status 0 instead, every rank at the same step, so that
    the agent ends rather than restarts; ``ddpkit run`` then reads the record and ends with status 1.
    """


def write_record(directory: str | os.PathLike[str], exc: BaseException) -> None:
    """Record that this worker is failing with ``exc`` (call it inside the ``except`` block)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        exitcode = code if isinstance(code, int) else (0 if code is None else 1)
    else:
        exitcode = 1
    record = {
        "rank": int(os.environ.get("RANK", "0")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "time": time.time(),
        "exitcode": exitcode,
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": traceback.format_exc(),
    }
    if isinstance(exc, StopWithoutRestart):
        record["stopped"] = True
    _write(directory, record)


def write_hang_record(
    directory: str | os.PathLike[str],
    report: str,
    stragglers: list[int],
    mismatched: list[int],
    report_path: str | None,
    rank: int,
) -> None:
    """Record that the job hung (by the rank whose watchdog wrote the report); it wins over any other record."""
    record = {
        "rank": rank,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "time": time.time(),
        "exitcode": 1,
        "error": report.splitlines()[0] if report else "the job hung",
        "traceback": "",
        "hang": {"report": report, "stragglers": stragglers, "mismatched": mismatched, "path": report_path},
    }
    _write(directory, record, name=f"{record['attempt']}-hang")


def _write(directory: str | os.PathLike[str], record: dict[str, Any], name: str | None = None) -> None:
    stem = name if name is not None else f"{record['attempt']}-{record['rank']}"
    path = Path(directory) / f"{stem}.json"
    try:
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps(record), encoding="utf-8")
        temporary.replace(path)
    except OSError:
        pass  # the record is a diagnosis aid; never mask the worker's own error


def read_records(directory: str | os.PathLike[str]) -> dict[int, dict[str, Any]]:
    """The records of the last attempt that left any, by global rank (a hang record under its own rank)."""
    records: list[dict[str, Any]] = []
    for path in Path(directory).glob("*.json"):
        try:
            records.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    if not records:
        return {}
    last = max(int(r["attempt"]) for r in records)
    latest = [r for r in records if int(r["attempt"]) == last]
    return {int(r["rank"]): r for r in sorted(latest, key=lambda r: "hang" in r)}  # the hang record wins


def earliest(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The record written first (the root cause on one machine), or ``None`` for no records."""
    return min(records.values(), key=lambda r: float(r["time"])) if records else None


def stopped_record(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The lowest rank's record of a :class:`StopWithoutRestart`, if any rank wrote one."""
    return next((records[rank] for rank in sorted(records) if records[rank].get("stopped")), None)


def hang_record(records: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The watchdog's record of a hang, if one was written (it wins over any other)."""
    return next((r for r in records.values() if "hang" in r), None)


def worker_failed_error(err: Any, records: dict[int, dict[str, Any]]) -> WorkerFailedError:
    """Combine torch's ``ChildFailedError`` with the workers' records into one error.

    The root cause is, in order: a hang (a :class:`~ddpkit.HangError` with the
    watchdog's report); a worker killed by a signal that left no record (a crash
    or a kill, which the others' errors follow from); else the earliest record;
    else the agent's first failure.
    """
    failures: dict[int, str] = {rank: str(r["error"]) for rank, r in records.items()}
    for rank, failure in err.failures.items():
        failures.setdefault(rank, _agent_failure_text(failure)[0])
    hang = hang_record(records)
    if hang is not None:
        details = hang["hang"]
        return HangError(
            details["report"], list(details["stragglers"]), details.get("path"), int(hang["rank"]), failures,
            list(details.get("mismatched", [])),
        )  # fmt: skip

    killed = [rank for rank, f in err.failures.items() if f.exitcode < 0 and rank not in records]
    if killed:
        rank = min(killed)
        text, trace = _agent_failure_text(err.failures[rank])
        return WorkerFailedError(rank, err.failures[rank].exitcode, text, trace, failures)
    first = earliest(records)
    if first is not None:
        return WorkerFailedError(
            int(first["rank"]), int(first["exitcode"]), first["error"], first["traceback"], failures
        )
    rank, failure = err.get_first_failure()
    text, trace = _agent_failure_text(failure)
    return WorkerFailedError(rank, failure.exitcode, text, trace, failures)


def _agent_failure_text(failure: Any) -> tuple[str, str]:
    """(error text, traceback) of one of the agent's ``ProcessFailure`` objects."""
    message = failure.message
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(message.get("message", "")), str(extra.get("py_callstack", "")) if isinstance(extra, dict) else ""
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}", ""
    return f"exited with code {failure.exitcode} (its stderr above has the details)", ""
