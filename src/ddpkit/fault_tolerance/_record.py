"""A fault-tolerant job's record on its machine: once a replica group has trained the job's last step, the job
is finished, and a group that starts or is started again after that trains nothing.

``ddpkit run --fault-tolerance`` (and ``fit_distributed``) on one machine makes a directory that only its user
can read or write and names it to every group in :data:`RECORD_VARIABLE`; rank 0 of each group that ends its
training writes ``finished.json`` there (``{"step": N, "by": "group-0"}``, replaced in one rename).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["RECORD_VARIABLE", "Finished", "finished", "job_record", "record_finished"]

#: The job's record directory, for every group of a fault-tolerant job on one machine.
RECORD_VARIABLE = "DDPKIT_FT_RECORD"
_FILE = "finished.json"


@dataclass(frozen=True)
class Finished:
    """The job finished: ``by`` (a replica group's id) committed its last step, the job's ``step``-th."""

    step: int
    by: str


@contextmanager
def job_record() -> Iterator[str]:
    """A new record directory for one job (mode 0700), removed when the block ends."""
    directory = tempfile.mkdtemp(prefix="ddpkit-ft-job-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def finished() -> Finished | None:
    """The job's record that it finished, or ``None`` (none yet, or no record directory named)."""
    directory = os.environ.get(RECORD_VARIABLE)
    if not directory:
        return None
    try:
        with open(os.path.join(directory, _FILE), encoding="utf-8") as file:
            said = json.load(file)
        return Finished(int(said["step"]), str(said["by"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def record_finished(step: int, by: str) -> None:
    """Record that the job finished at ``step`` (committed by replica group ``by``), where a record directory is
    named; nothing otherwise."""
    directory = os.environ.get(RECORD_VARIABLE)
    if not directory or not os.path.isdir(directory):
        return
    descriptor, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump({"step": step, "by": by}, file)
    os.replace(temporary, os.path.join(directory, _FILE))
