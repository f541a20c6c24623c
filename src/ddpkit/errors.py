"""Exceptions and warnings raised by ddpkit (this module imports nothing from ddpkit but ``_compat``).

Every ddpkit error derives from :class:`DDPKitError`, itself a ``RuntimeError``,
so ``except RuntimeError`` written for ``torch.distributed`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ClusterEnvironmentError",
    "CollectiveMismatchError",
    "DDPKitError",
    "GroupProofError",
    "HangError",
    "JobSecretError",
    "PortTakenError",
    "RendezvousFailedError",
    "WarningDDP",
    "WorkerFailedError",
]

from ddpkit._compat import override


class DDPKitError(RuntimeError):
    """Base class of every error ddpkit raises on purpose."""


class CollectiveMismatchError(DDPKitError):
    """Ranks passed incompatible inputs to the same collective.

    Raised on every rank, with each rank's value in the message (for example
    ``"rank 0: float32 (4, 8); rank 1: float32 (4,)"``); the process group stays
    usable afterwards.
    """


class ClusterEnvironmentError(DDPKitError):
    """The cluster's environment variables are missing, half-set or contradictory.

    The message names each offending variable with its value and says what to set.
    """


class WorkerFailedError(DDPKitError):
    """A worker process of a launched job failed.

    Attributes:
        rank: global rank of the first worker that failed (the root cause).
        exitcode: that worker's exit code (negative: killed by that signal number).
        error: the worker's error text, e.g. ``"ValueError: bad batch"``.
        traceback: the worker's Python traceback, or ``""`` when it left none
            (for instance a script that did not use ``@record``, or a worker
            killed by a signal); its stderr then holds the traceback.
        failures: ``{rank: error text}`` for every worker that failed.
    """

    def __init__(
        self,
        rank: int,
        exitcode: int,
        error: str,
        traceback: str = "",
        failures: dict[int, str] | None = None,
    ) -> None:
        self.rank = rank
        self.exitcode = exitcode
        self.error = error
        self.traceback = traceback
        self.failures = dict(failures) if failures is not None else {rank: error}
        lines = [f"rank {rank} failed (exit code {exitcode}): {error}"]
        others = {r: e for r, e in sorted(self.failures.items()) if r != rank}
        if others:
            lines.append("then: " + "; ".join(f"rank {r}: {e}" for r, e in others.items()))
        if traceback:
            lines.append(f"traceback of rank {rank}:\n{traceback.rstrip()}")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type[WorkerFailedError], tuple[int, int, str, str, dict[int, str]]]:
        return (type(self), (self.rank, self.exitcode, self.error, self.traceback, self.failures))


class HangError(WorkerFailedError):
    """A launched job hung: a rank waited in a collective past the deadline, and the job was stopped.

    The message is the watchdog's report: the rank(s) that did not arrive, every
    rank's collective (op, sequence number, shapes and dtypes) or none, where
    each rank's code was (its Python stack, the user's own frames marked), and
    the path of the full report file. A ``WorkerFailedError``, so code that
    catches those catches this too.

    Attributes:
        report: the report text (the message).
        stragglers: ranks that did not arrive at the collective the others wait
            in (or did not answer); empty when the ranks called mismatched
            collectives or every rank is stuck in the same one.
        mismatched: ranks whose collective differs from the others' at the same
            point (a different op, shape or dtype).
        report_path: the full report (every thread of every rank), or ``None``.
        rank: the first straggler, else the first mismatched rank, else the rank
            that wrote the report.
    """

    def __init__(
        self,
        report: str,
        stragglers: list[int],
        report_path: str | None = None,
        rank: int = 0,
        failures: dict[int, str] | None = None,
        mismatched: list[int] | None = None,
    ) -> None:
        self.report = report
        self.stragglers = list(stragglers)
        self.mismatched = list(mismatched or [])
        self.report_path = report_path
        self.rank = rank
        self.exitcode = 1
        self.error = report.splitlines()[0] if report else "the job hung"
        self.traceback = ""
        self.failures = dict(failures) if failures is not None else {rank: self.error}
        DDPKitError.__init__(self, report)

    @override
    def __reduce__(  # type: ignore[override]
        self,
    ) -> tuple[type[HangError], tuple[str, list[int], str | None, int, dict[int, str], list[int]]]:
        return (type(self), (self.report, self.stragglers, self.report_path, self.rank, self.failures, self.mismatched))


class PortTakenError(DDPKitError):
    """A port that a rendezvous store must listen on is held by another program (the message names it)."""


class RendezvousFailedError(DDPKitError):
    """The nodes of a launch did not meet: a node is missing or unreachable, or its rendezvous port is taken.

    The message names the endpoint, the number of nodes expected, how long this
    node waited, and what to check.
    """


class GroupProofError(DDPKitError):
    """A member of a new process group could not prove that it holds the job secret.

    Raised on every rank that holds the secret, right after the group was made
    and before any of the job's data moved through it; the group is torn down.
    The message names each member that failed (its rank and, where the backend
    says, its address) and why (a wrong proof, or none within the deadline).

    Attributes:
        members: ``{rank in the group: what is known of it}`` for each member that failed: its address
            (``"at HOST:PORT"``) and, in a fault-tolerant quorum, its replica id; ``""`` where nothing is.
    """

    def __init__(self, message: str, members: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.members = dict(members or {})

    def __reduce__(self) -> tuple[type[GroupProofError], tuple[str, dict[int, str]]]:
        return (type(self), (str(self), self.members))


class JobSecretError(DDPKitError, ValueError):
    """The job secret cannot be used: it is empty, a stranger could guess it (below 128 bits), or it is in a file
    that other users can read.

    Raised where the secret is read (``ddpkit run --secret-file``, ``DDPKIT_JOB_SECRET``), on every process that
    reads it, before anything is signed with it. The message names where the secret came from, what is wrong
    with it, and the command that makes a good one (``ddpkit secret PATH``). Also a ``ValueError``.
    """


class WarningDDP(UserWarning):
    """A DDP helper was used without a process group and left its input unchanged (OML's ``WarningDDP``).

    As OML's ``oml.ddp.utils.WarningDDP``, it is built from the function's name:
    ``warnings.warn("sync_dicts_ddp", WarningDDP)`` explains what happened.
    """

    def __init__(self, function_name: str) -> None:
        super().__init__(function_name)
        self.function_name = function_name
        self.message = (
            f"You use '{function_name}' function, but the default process group has not been initialized. "
            "In this case for compatibility function doesn't modify your data. Please make sure to call "
            "init_process_group (or ddpkit.init_dist_connection) or ignore this warning if you want to use "
            "this function without DDP"
        )

    @override
    def __str__(self) -> str:
        return self.message
