"""What a user sees while the elastic agent runs a job (private).

torch's agent logs every worker failure with the worker's whole traceback
(tens of ``E... api.py:836]`` lines), its ``OMP_NUM_THREADS`` banner and its
restarts at INFO, which is not shown. :func:`agent_log` sends all of it to a log
file instead (``DDPKIT_VERBOSE=1`` keeps it on stderr as well) and prints one
line per restart on stderr, naming the rank that failed first and why; the
summary of a failed job (:class:`~ddpkit.WorkerFailedError`) names the file. A
launch that neither failed nor restarted leaves no file.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit._failures import earliest, hang_record, read_records
from ddpkit.environments.replica_group import REPLICA_ID_VARIABLE

__all__ = ["VERBOSE_VARIABLE", "AgentLog", "agent_log", "is_verbose"]

#: Set to ``1`` to see torch's launcher log on stderr too (``ddpkit run --verbose``).
VERBOSE_VARIABLE = "DDPKIT_VERBOSE"
# The loggers of torch's elastic agent (first), torchrun, the launcher API and the agent's process pool.
_AGENT_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.run",
    "torch.distributed.launcher",
    "torch.multiprocessing.spawn",
)
# The logger that says, at INFO, that the agent restarts its workers.
_RESTART_LOGGER = "torch.distributed.elastic.agent.server.api"


def is_verbose() -> bool:
    """Whether the user asked for torch's own output (``DDPKIT_VERBOSE`` set, and not ``0``)."""
    return os.environ.get(VERBOSE_VARIABLE, "0") not in ("", "0")


@dataclass
class AgentLog:
    """The log file of one launch (created at its first line) and the workers' exits seen so far."""

    path: Path
    failure_dir: str
    logger: logging.Logger
    exits: dict[int, int] = field(default_factory=dict)  # local rank -> exit code, this attempt
    keep: bool = False  # a launch without failures or restarts leaves no file

    def note(self) -> str:
        """The line a failed launch's error ends with."""
        return f"torch's launcher log and every failed rank's traceback: {self.path}"

    def restart_line(self, restart: int, max_restarts: int) -> str:
        """``ddpkit: restart 1 of 3: rank 1 failed: ValueError: boom (tracebacks: FILE)``; the agent of a
        fault-tolerant job's replica group names it: ``ddpkit: replica group group-2: restart 1 of 3: ...``."""
        group = os.environ.get(REPLICA_ID_VARIABLE)
        where = f"replica group {group}: " if group else ""
        return f"ddpkit: {where}restart {restart} of {max_restarts}: {self.cause()} (tracebacks: {self.path})"

    def cause(self) -> str:
        """Why this attempt's workers stopped, the first failure first (as ``WorkerFailedError`` decides)."""
        records = read_records(self.failure_dir)
        hang = hang_record(records)
        if hang is not None:
            return str(hang["error"])
        killed = sorted(local for local, code in self.exits.items() if code < 0)
        if killed:
            return f"local rank {killed[0]} was killed by signal {_signal_name(self.exits[killed[0]])}"
        first = earliest(records)
        if first is not None:
            return f"rank {first['rank']} failed: {str(first['error']).partition(chr(10))[0]}"
        if self.exits:
            local, code = min(self.exits.items())
            return f"local rank {local} exited with code {code}"
        return "a worker stopped"

    def write_tracebacks(self) -> None:
        """Put this attempt's records (every failed rank's traceback) in the log file, and keep the file."""
        self.keep = True
        for rank, record in sorted(read_records(self.failure_dir).items()):
            self.logger.error("rank %d: %s", rank, record["traceback"] or record["error"])


class _AgentEvents(logging.Handler):
    """Turns the agent's records into ddpkit's lines: a failed worker's exit, a restart, nodes that join."""

    def __init__(self, log: AgentLog) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        message, args = record.msg, record.args
        if not isinstance(message, str) or not isinstance(args, tuple):
            return
        if message.startswith("failed (exitcode: %s) local_rank: %s") and len(args) >= 2:
            self.log.exits[int(str(args[1]))] = int(str(args[0]))
        elif "attempts left" in message and len(args) >= 4:
            remaining, max_restarts = int(str(args[2])), int(str(args[3]))
            self.log.write_tracebacks()
            # one write per line (print makes two): other agents' and workers' lines share the stream
            sys.stderr.write(self.log.restart_line(max_restarts - remaining + 1, max_restarts) + "\n")
            sys.stderr.flush()
            self.log.exits.clear()
        elif "new nodes from group_rank" in message and len(args) >= 2:
            sys.stderr.write(f"ddpkit: {args[1]} node(s) joined: restarting the workers on the larger group\n")


@contextmanager
def agent_log(failure_dir: str) -> Iterator[AgentLog]:
    """Route torch's launcher logs to a file for the duration of one launch (see the module docstring)."""
    # mkstemp: a new file of a random name (O_CREAT | O_EXCL, mode 0600), so that nobody who can write the temp
    # directory can plant a symlink there and have the job append to a file of theirs.
    descriptor, name = tempfile.mkstemp(prefix=f"ddpkit-launch-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
    os.close(descriptor)
    path = Path(name)
    log = AgentLog(path, failure_dir, logging.getLogger("ddpkit.launch.tracebacks"))
    file_handler = logging.FileHandler(path, delay=True, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    events = _AgentEvents(log)
    loggers = [logging.getLogger(name) for name in _AGENT_LOGGERS] + [log.logger]
    saved = [(logger, logger.propagate) for logger in loggers]
    for logger in loggers:
        logger.addHandler(file_handler)
        logger.propagate = is_verbose() and logger is not log.logger
    loggers[0].addHandler(events)
    restart_logger = logging.getLogger(_RESTART_LOGGER)
    saved_level = restart_logger.level
    restart_logger.setLevel(logging.INFO)  # torch logs its restarts at INFO
    try:
        yield log
    finally:
        restart_logger.setLevel(saved_level)
        loggers[0].removeHandler(events)
        for logger, propagate in saved:
            logger.removeHandler(file_handler)
            logger.propagate = propagate
        file_handler.close()
        if not log.keep:
            path.unlink(missing_ok=True)


def _signal_name(exitcode: int) -> str:
    import signal

    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return str(-exitcode)
