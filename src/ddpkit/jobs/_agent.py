"""The launching side of a job, shared by ``launch`` and ``ddpkit run``: the elastic agent's set-up and its errors.

* :func:`agent_scope`: each restart attempt gets its own process-group store
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: on torch 2.13 a restarted
  attempt's ``init_process_group`` found the previous attempt's keys in the
  agent's shared store and failed to connect), the workers get a directory for
  failure records, and afterwards the caller's environment and signal handlers
  are restored.
* :func:`rendezvous` and :func:`rendezvous_store`: loopback and a free port by
  default; the store bound to one address (loopback, or on several nodes the
  rendezvous host's own address: torch's would listen on every interface); each
  node advertises its address on its route to the rendezvous host; a host that
  does not resolve refused at once; torch's c10d rendezvous with every state
  checked before it is unpickled (:mod:`ddpkit.jobs._rendezvous`).
* :func:`translated_failures`: torch's ``ChildFailedError`` and
  ``RendezvousError`` become :class:`~ddpkit.WorkerFailedError` (or
  :class:`~ddpkit.HangError`) naming the first failing rank, and
  :class:`~ddpkit.RendezvousFailedError`; meanwhile torch's launcher log goes to
  a file (:mod:`ddpkit.jobs._agent_log`), which the error names, and each restart
  prints one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ddpkit._backends import default_nprocs
from ddpkit._failures import (
    FAILURE_DIR_VARIABLE,
    StopWithoutRestart,
    read_records,
    stopped_record,
    worker_failed_error,
)
from ddpkit._stores import hosting_address, release_store, route_address, serve_store
from ddpkit._torch_private import private
from ddpkit._trust.group_store import JOB_ID_VARIABLE
from ddpkit._trust.secret import SECRET_VARIABLE, export_job_secret, job_secret, new_job_secret
from ddpkit.environments import is_loopback
from ddpkit.environments.base import check_resolves
from ddpkit.environments.replica_group import LIGHTHOUSE_VARIABLE
from ddpkit.errors import ClusterEnvironmentError, RendezvousFailedError
from ddpkit.hangs._watchdog import TIMEOUT_VARIABLE
from ddpkit.jobs import _rendezvous
from ddpkit.jobs._agent_log import agent_log

__all__ = [
    "SHUTDOWN_GRACE_S",
    "agent_scope",
    "check_counts",
    "default_nprocs",
    "node_range",
    "rdzv_configs",
    "rendezvous",
    "rendezvous_store",
    "shutdown_grace",
    "translated_failures",
]

#: Seconds the agent waits after SIGTERM before it SIGKILLs the remaining workers.
SHUTDOWN_GRACE_S = 5


def shutdown_grace() -> dict[str, Any]:
    """``{"shutdown_timeout": SHUTDOWN_GRACE_S}`` for ``LaunchConfig``, or ``{}`` on a torch older than 2.13
    (below our floor, but what GPU images often hold): its agent has no such setting and keeps its own 30 s."""
    from torch.distributed.launcher.api import LaunchConfig

    fields = getattr(LaunchConfig, "__dataclass_fields__", {})
    return {"shutdown_timeout": SHUTDOWN_GRACE_S} if "shutdown_timeout" in fields else {}


# Environment variables the elastic agent reads or writes in the launching process.
_AGENT_ENV = (
    JOB_ID_VARIABLE,
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
    "OMP_NUM_THREADS",
    FAILURE_DIR_VARIABLE,
    TIMEOUT_VARIABLE,
    SECRET_VARIABLE,
)
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")


def check_counts(nprocs: int, max_restarts: int) -> None:
    """Raise ``ValueError`` naming the first count out of range."""
    for name, value, low in (("nprocs", nprocs, 1), ("max_restarts", max_restarts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")


def node_range(nnodes: int | str) -> tuple[int, int]:
    """``(min, max)`` nodes of ``nnodes``: ``N`` (or ``"N"``), or torchrun's elastic ``"MIN:MAX"``.

    Raises:
        ValueError: not of that form, ``MIN < 1`` or ``MAX < MIN``.
    """
    text = str(nnodes).strip() if not isinstance(nnodes, bool) else ""
    low, colon, high = text.partition(":")
    try:
        bounds = (int(low), int(high if colon else low))
    except ValueError:
        bounds = (0, 0)
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(
            f"nnodes={nnodes!r} must be a number of nodes >= 1, or 'MIN:MAX' with 1 <= MIN <= MAX (an elastic job "
            "that runs while at least MIN nodes are up, e.g. '1:4')"
        )
    return bounds


def rdzv_configs(join_timeout: float | None, extra: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """torch's rendezvous settings: ``extra`` (a mapping, or torchrun's ``--rdzv-conf`` text
    ``"KEY=VALUE,..."``), and ``join_timeout`` in whole seconds.

    Raises:
        ValueError: ``extra`` is text not of that form.
    """
    if isinstance(extra, str):
        pairs = [item.partition("=") for item in extra.split(",") if item.strip()]
        if any(not key.strip() or not sep for key, sep, _ in pairs):
            raise ValueError(f"rdzv_conf={extra!r} must be KEY=VALUE[,KEY=VALUE...], e.g. 'last_call_timeout=5'")
        extra = {key.strip(): value.strip() for key, _, value in pairs}
    configs = dict(extra or {})
    if join_timeout is not None:
        configs["join_timeout"] = max(1, round(join_timeout))
    return configs


def rendezvous(nnodes: int | str, rdzv_endpoint: str | None, run_id: str | None) -> tuple[str, str, str | None]:
    """``(endpoint, run id, local address)`` for the rendezvous, whose backend (``"ddpkit"``) it registers.

    The run id, unless given: a fresh one on a single node; on several, one
    from the scheduler's job id where there is one, else ``"ddpkit"``. The local
    address (what this node advertises, and where its rank 0 hosts the
    process-group store): loopback, or this node's address on its route to
    the rendezvous host. Several nodes without a job secret warn once.

    Raises:
        ValueError: several nodes without an endpoint.
        RendezvousFailedError: the endpoint's host does not resolve (naming it).
    """
    several = node_range(nnodes)[1] > 1
    if several and not rdzv_endpoint:
        raise ValueError(
            f"nnodes={nnodes!r} needs rdzv_endpoint='HOST:PORT', the same on every node "
            "(HOST is the machine that hosts the rendezvous, reachable from all nodes)"
        )
    # Port 0: the single agent binds a free port itself, with no window for a race.
    endpoint = rdzv_endpoint or "127.0.0.1:0"
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        check_resolves(host, f"the host of rdzv_endpoint={endpoint!r}")
    except ClusterEnvironmentError as exc:
        raise RendezvousFailedError(str(exc)) from None
    local_addr = "127.0.0.1" if is_loopback(host) else route_address(host)
    _rendezvous.register()
    _rendezvous.forget_refusals()
    if several:
        _rendezvous.warn_without_secret(endpoint)
        run_id = run_id or _rendezvous.default_run_id() or "ddpkit"
    return endpoint, run_id or uuid.uuid4().hex, local_addr


@contextmanager
def agent_scope(nnodes: int | str = 1) -> Iterator[str]:
    """Set up one launch: each restart attempt gets its own store, workers get a failure-record
    directory (yielded) and the job secret; afterwards, undo what the agent changed in this process.

    The workers find the job secret in their environment (``DDPKIT_JOB_SECRET``):
    the one this process has (the variable, or ``ddpkit run --secret-file``),
    or on a single node without one, a fresh secret of this job's own, so that
    nobody else on the machine can take a rank either (not for a replica group
    of a fault-tolerant job started by hand: its job's groups share one secret).
    """
    saved_env = {name: os.environ.get(name) for name in _AGENT_ENV}
    saved_signals = _current_handlers()
    failure_dir = tempfile.mkdtemp(prefix="ddpkit-failures-")
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[FAILURE_DIR_VARIABLE] = failure_dir
    # A replica group of a fault-tolerant job started by hand has no secret of its own to draw: the job's
    # other groups would not share it (it warns instead, when it joins).
    if job_secret() is None and node_range(nnodes)[1] == 1 and LIGHTHOUSE_VARIABLE not in os.environ:
        os.environ[SECRET_VARIABLE] = new_job_secret().decode()
    export_job_secret(os.environ)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, forward_to_workers)  # SLURM's warning before the walltime, for the ranks
    try:
        yield failure_dir
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)


@contextmanager
def rendezvous_store(
    endpoint: str, nnodes: int | str, configs: Mapping[str, Any], run_id: str = "ddpkit"
) -> Iterator[str]:
    """Host the rendezvous store on the endpoint's address alone when this node hosts it; yield the
    endpoint with its real port (a free one for port 0).

    With a job secret, the host writes the job's id (signed) into its new store
    before any agent joins (:func:`~ddpkit.jobs._rendezvous.claim_job`): every
    signature of the rendezvous binds it, so nothing signed in an earlier job
    passes in this one.

    This node hosts it when the endpoint is loopback, when ``configs`` say
    ``is_host``, or, without ``is_host``, when the endpoint names this machine
    (torch's rule). With several nodes, another agent on this machine may
    host it already.

    Raises:
        RendezvousFailedError: this node is to host a rendezvous whose host is
            none of its addresses (naming the host and the addresses it has).
        PortTakenError: the port is held by another program.
    """
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    several = node_range(nnodes)[1] > 1
    served = None
    if is_loopback(host) or _hosts_rendezvous(host, configs):
        served = serve_store(hosting_address(host), int(port), if_taken="peer" if several else "raise")
    try:
        if served is not None and job_secret() is not None:
            _claim_job(hosting_address(host), served, run_id)
        yield endpoint if served is None else f"{host}:{served}"
    finally:
        release_store(served)


def _claim_job(address: str, port: int, run_id: str) -> None:
    """Write the job's id into the store this node just started (see :func:`rendezvous_store`)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    secret = job_secret()
    assert secret is not None
    client = TCPStore(address, port, is_master=False, timeout=timedelta(seconds=30))
    try:
        _rendezvous.claim_job(client, run_id, f"{address}:{port}", secret, first=True)
    except _rendezvous.StateRefusedError as refusal:
        raise RendezvousFailedError(str(refusal)) from None


def _hosts_rendezvous(host: str, configs: Mapping[str, Any]) -> bool:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    told = RendezvousParameters(_rendezvous.BACKEND, host, "-", 1, 1, **configs).get_as_bool("is_host")
    return bool(told) if told is not None else bool(private("matches_machine_hostname")(host))


@contextmanager
def translated_failures(
    failure_dir: str, endpoint: str, nnodes: int | str, join_timeout: float | None
) -> Iterator[None]:
    """Turn the elastic agent's errors into ddpkit's, its log into a file (see the module docstring)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    with agent_log(failure_dir) as log:
        try:
            with _refusal_first():
                yield
            stopped = stopped_record(read_records(failure_dir))
            if stopped is not None:  # its workers exited with status 0 so that the agent ended
                print(f"ddpkit: rank {stopped['rank']} stopped ({stopped['error']}): the workers are not started "
                      "again", file=sys.stderr, flush=True)  # fmt: skip
                raise StopWithoutRestart(1)
        except ChildFailedError as err:  # torch's text repeats a worker's traceback that ours names
            _release_frames(err)
            log.write_tracebacks()
            error = worker_failed_error(err, read_records(failure_dir))
            error.add_note(log.note())
            raise error from None
        except RendezvousError as err:
            _release_frames(err)
            raise _rendezvous_failed(err, endpoint, nnodes, join_timeout) from None


@contextmanager
def _refusal_first() -> Iterator[None]:
    """A launch that fails after this process refused a rendezvous state reports the refusal: the agent that
    refused first stops, and the others may see its workers or its store go before they read the state."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    try:
        yield
    except (ChildFailedError, RendezvousError) as err:
        refusal = _rendezvous.last_refusal()
        if refusal is None:
            raise
        _release_frames(err)
        raise RendezvousFailedError(str(refusal)) from None


def _rendezvous_failed(
    err: Exception, endpoint: str, nnodes: int | str, join_timeout: float | None
) -> RendezvousFailedError:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    if isinstance(err, _rendezvous.StateRefusedError):
        return RendezvousFailedError(str(err))
    if isinstance(err, RendezvousConnectionError):
        return RendezvousFailedError(
            f"this node cannot reach the rendezvous store at {endpoint}. If the job was running, the agent that "
            "hosts the store has stopped (the first one started on the endpoint's host): a job survives losing any "
            "node but that one, whatever its nnodes. Otherwise check that the endpoint is reachable from this node"
        )
    waited = f"{join_timeout:g} s" if join_timeout is not None else "the join timeout (600 s by default)"
    detail = f" ({type(err).__name__}: {err})" if str(err) else f" ({type(err).__name__})"
    return RendezvousFailedError(
        f"the rendezvous at {endpoint} did not complete: this node waited {waited} for {nnodes} node(s) and fewer "
        f"joined{detail}. Start the same command on every node with the same rendezvous endpoint and id (and "
        f"nnodes={nnodes}), check that {endpoint} is reachable from each node and that no other program holds "
        "its port"
    )


def _release_frames(err: BaseException) -> None:
    """Clear the locals of the agent's finished frames in ``err``'s traceback.

    They hold the rendezvous store, whose server would otherwise keep listening
    for as long as the caller keeps the exception (the traceback still prints).
    """
    traceback.clear_frames(err.__traceback__)


def forward_to_workers(signum: int, frame: object = None) -> None:
    """Send ``signum`` to this process's workers (its children but multiprocessing's helpers): SLURM's SIGUSR1
    before the walltime that reaches the agent goes on to the ranks, which act on it (a ``TrainLoop``
    checkpoints at its next step), instead of ending the agent."""
    for pid in worker_children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def worker_children(parent: int) -> list[int]:
    """The children of ``parent`` that run a worker, not multiprocessing's resource tracker or fork server
    (Linux ``/proc``; none elsewhere)."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return []
    workers = []
    for child in children:
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in command and b"forkserver" not in command:
            workers.append(int(child))
    return workers


def _current_handlers() -> dict[signal.Signals, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for name in _AGENT_SIGNALS if (sig := getattr(signal, name, None)) is not None}
