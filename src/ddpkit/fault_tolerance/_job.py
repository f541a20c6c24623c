"""A fault-tolerant job's replica groups, each under an elastic agent of its own: ``ddpkit run --fault-tolerance``
and ``TrainLoop.fit_distributed`` with fault tolerance.

This process serves torchft's lighthouse on loopback (or, on several nodes, the node whose address the
endpoint is); every replica group is a child of this process under an elastic agent of its own, with
``TORCHFT_LIGHTHOUSE`` and ``REPLICA_GROUP_ID`` set, and the job's secret in ``DDPKIT_JOB_SECRET`` (the one
this process was given, else one drawn for this job): every quorum's members prove they hold it. When a rank of
a group dies, its agent starts the group again and it rejoins the quorum, while the other groups go on in
their processes. How a group is started is the caller's (:data:`StartGroup`): ``ddpkit run -n M`` of a script
(:func:`script_groups`), or a process whose agent runs a function (``fit_distributed``'s).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Protocol

from ddpkit._backends import default_nprocs
from ddpkit._stores import LoopbackHostError
from ddpkit._trust.secret import SECRET_VARIABLE, job_secret, new_job_secret
from ddpkit.environments import CLUSTER_ENV_VARIABLE
from ddpkit.environments.replica_group import GROUPS_VARIABLE, LIGHTHOUSE_VARIABLE, REPLICA_ID_VARIABLE
from ddpkit.errors import PortTakenError, RendezvousFailedError
from ddpkit.fault_tolerance._lighthouse import Lighthouse, serve_lighthouse
from ddpkit.fault_tolerance._torchft import bracketed, local_address, url_host

__all__ = [
    "Child",
    "StartGroup",
    "job_shape_problems",
    "run_node_group",
    "run_replica_groups",
    "script_groups",
    "serve_until_interrupted",
]

#: Seconds the node that serves the lighthouse keeps it up, once its own group ended, while other groups heartbeat.
AFTER_OWN_GROUP_S = 120.0


class Child(Protocol):
    """A started replica group's process, as ``subprocess.Popen`` has it."""

    pid: int

    def wait(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, signum: int) -> None: ...


#: How a replica group starts: ``(replica id, its ranks or None for the default, the variables to add to this
#: process's environment)`` -> its process, whose agent starts its ranks again when one dies.
StartGroup = Callable[[str, int | None, dict[str, str]], Child]


def script_groups(script: str, script_args: Sequence[str], *, max_restarts: int, module: bool = False) -> StartGroup:
    """Start each replica group as ``ddpkit run -n RANKS --max-restarts max_restarts [-m] script *script_args``."""

    def start(replica_id: str, size: int | None, variables: dict[str, str]) -> Child:
        command = [sys.executable, "-m", "ddpkit", "run", *(["-n", str(size)] if size else []),
                   "--max-restarts", str(max_restarts), *(["-m"] if module else []), script, *script_args]  # fmt: skip
        return subprocess.Popen(command, env={**os.environ, **variables})

    return start


def job_shape_problems(nnodes: int | str, endpoint: str | None, group_size: int, *, flags: bool) -> list[str]:
    """What a fault-tolerant job of ``nnodes`` nodes (one replica group a node) with the lighthouse at ``endpoint``
    and groups of ``group_size`` ranks cannot be, each naming the argument (``--nnodes`` with ``flags``, else
    ``nnodes=``) and why: ``ddpkit run --fault-tolerance`` and ``fit_distributed`` check it alike."""

    def named(name: str, value: object) -> str:
        return f"--{name.replace('_', '-')} {value}" if flags else f"{name}={value!r}"

    whole = str(nnodes).isdigit() and not isinstance(nnodes, bool)
    several = whole and int(nnodes) > 1
    problems = []
    if not whole or int(nnodes) < 1:
        problems.append(f"{named('nnodes', nnodes)} (one replica group a node: a whole number of nodes; fault "
                        "tolerance goes on with the groups left, so MIN:MAX has no use here)")  # fmt: skip
    if several and endpoint is None:
        problems.append(f"{named('nnodes', nnodes)} without {'--rdzv-endpoint' if flags else 'rdzv_endpoint'} "
                        "HOST:PORT, the same on every node: where the lighthouse listens (served by the node whose "
                        "address HOST is, or by `ddpkit lighthouse`)")  # fmt: skip
    if not several and endpoint is not None and str(nnodes) == "1":
        problems.append(f"{named('rdzv_endpoint', endpoint)} (the lighthouse of a job on several nodes)")
    if several and group_size != 1:
        problems.append(f"{named('group_size', group_size)} (with several nodes, each node's ranks are one group)")
    return problems


def run_replica_groups(
    start: StartGroup, *, groups: int, lighthouse: str | None = None, min_replicas: int = 1, group_size: int = 1
) -> list[int]:
    """Run ``groups`` replica groups on this machine, named ``group-0``, ``group-1``, ... (each of ``group_size``
    ranks, started by ``start``), with the job's lighthouse on loopback in this process (or at ``lighthouse``,
    one that runs already). Every group gets
    the job secret in its environment: this process's (``DDPKIT_JOB_SECRET`` or ``--secret-file``), else one
    drawn for this job (32 random bytes), and their number (``DDPKIT_REPLICA_GROUPS``: the job's first step
    waits for them all). Returns each group's exit status (Ctrl-C or SIGTERM stops them all: 130 each).

    Raises:
        ValueError: ``groups`` or ``group_size`` below 1.
        ImportError: torchft is not installed (the message says how to install it).
    """
    if groups < 1 or group_size < 1:
        raise ValueError(f"{groups} replica groups of {group_size} ranks: start at least one group of one rank")
    secret = job_secret() or new_job_secret()  # one for the whole job
    if lighthouse is not None:
        return _run_groups(start, groups, group_size, lighthouse, secret)
    with serve_lighthouse("127.0.0.1", min_replicas=min_replicas, secret=secret) as served:
        print(f"ddpkit: torchft's lighthouse at {served.address}", file=sys.stderr, flush=True)
        return _run_groups(start, groups, group_size, served.address, secret)


def run_node_group(
    start: StartGroup, *, nnodes: int, endpoint: str, nprocs: int | None, replica_id: str | None = None,
    min_replicas: int = 1,
) -> int:  # fmt: skip
    """This node's replica group of a fault-tolerant job of ``nnodes`` nodes, one group a node: ``nprocs`` ranks
    started by ``start`` under an agent of their own, named ``replica_id`` (default this machine's host name),
    with torchft's lighthouse at ``endpoint``
    (under ``srun``, one task a node: the group's processes are this command's, not tasks of SLURM's),
    (``HOST:PORT``). The node whose address ``HOST`` is serves the lighthouse there (unless another process of
    this machine does already), and keeps serving it once its own group ended while other groups still
    heartbeat (up to :data:`AFTER_OWN_GROUP_S` seconds). Every group's first step waits for ``nnodes`` groups.
    Returns the group's exit status (130 after Ctrl-C or SIGTERM).

    Raises:
        ValueError: no job secret (``--secret-file`` or ``DDPKIT_JOB_SECRET``: the lighthouse and the groups' ports
            face the network), ``endpoint`` not ``HOST:PORT``, ``nnodes`` below 1, or no route from this machine to
            the endpoint's host, or a host name that resolves to loopback on its own machine.
        PortTakenError: the endpoint is this machine's and its port is taken by something other than torchft's
            lighthouse.
        ImportError: torchft is not installed (the message says how to install it).
    """
    secret = job_secret()
    if secret is None:
        raise ValueError(
            f"a fault-tolerant job on {nnodes} nodes needs the job secret: its lighthouse and its groups' ports face "
            "the network, and every quorum's members prove they hold it. Give every node the same file with "
            "--secret-file FILE (or DDPKIT_JOB_SECRET)"
        )
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or nnodes < 1:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} with --nnodes {nnodes}: give HOST:PORT and nnodes >= 1")
    host = url_host(f"{host}:{port}")
    name = replica_id or socket.gethostname()
    served = _lighthouse_here(host, int(port), min_replicas, secret)
    lighthouse = served.address if served is not None else f"http://{bracketed(host)}:{port}"
    where = "served by this command" if served is not None else "served by another process"
    try:
        listening = f"; the group's servers listen on {local_address(lighthouse)}"
    except RendezvousFailedError as error:
        if served is not None:
            served.shutdown()
        raise ValueError(str(error)) from None
    print(f"ddpkit: replica group {name!r} ({nprocs or 'one per GPU, or 1'} ranks), one of {nnodes}; torchft's "
          f"lighthouse at {lighthouse}, {where}{listening}", file=sys.stderr, flush=True)  # fmt: skip
    crowded = _crowded(nprocs)
    if crowded:
        print(f"ddpkit: warning: {crowded}", file=sys.stderr, flush=True)
    try:
        child = _start_group(start, name, nprocs, lighthouse, secret.decode(), nnodes, {CLUSTER_ENV_VARIABLE: "local"})
        warned: list[int] = []
        status = _wait([child], warned)[0]
        if status not in (0, 130) and warned:
            print(f"ddpkit: replica group {name!r} stopped after SLURM's warning (SIGUSR1, passed on to its ranks), "
                  f"exit status {status}", file=sys.stderr, flush=True)  # fmt: skip
        elif status not in (0, 130):
            print(f"ddpkit: replica group {name!r} ended with exit status {status} (no restart left): the other "
                  "groups go on without it", file=sys.stderr, flush=True)  # fmt: skip
        if served is not None and status != 130:
            _serve_while_others_heartbeat(served)
        return status
    finally:
        if served is not None:
            served.shutdown()


def _crowded(nprocs: int | None) -> str:
    """What to say when this command may run on fewer cores than the ranks it starts (they inherit its CPU
    affinity: one core, where srun gave the task one CPU or mpirun bound it to one); ``""`` otherwise."""
    if not hasattr(os, "sched_getaffinity"):
        return ""
    cores, machine = len(os.sched_getaffinity(0)), os.cpu_count() or 1
    ranks = nprocs or default_nprocs()
    if cores >= ranks or cores >= machine:
        return ""
    return (
        f"this command may run on {cores} of the machine's {machine} cores (its CPU affinity) and its {ranks} "
        "ranks share them: give the task the node's cores (srun --cpus-per-task N; mpirun --bind-to none)"
    )


def _lighthouse_here(host: str, port: int, min_replicas: int, secret: bytes) -> Lighthouse | None:
    """The lighthouse (and the job's record) served on ``host:port`` by this process, or ``None`` when ``host`` is
    not this machine's address or another process of this machine serves that port already (a second "node" of
    one machine)."""
    try:
        return serve_lighthouse(host, port, min_replicas=min_replicas, secret=secret)
    except LoopbackHostError as error:  # this machine's, through loopback only: the other nodes cannot reach it
        raise ValueError(
            f"--rdzv-endpoint {host}:{port}: {host} resolves to {', '.join(error.addresses)} here, a loopback "
            f"address that the other nodes cannot reach (is {host} mapped to 127.0.1.1 in /etc/hosts?); give the "
            "endpoint as this machine's address on the network that reaches the other nodes (its IP address, say)"
        ) from None
    except RendezvousFailedError:  # not this machine's address
        return None
    except Exception as error:  # torchft's bind error: taken, by the lighthouse another node here serves?
        if "in use" not in str(error).lower():
            raise
        if _status_page(f"http://{bracketed(host)}:{port}", timeout=2.0) is None:
            raise PortTakenError(
                f"--rdzv-endpoint {host}:{port}: the port is taken by a process that does not answer as torchft's "
                "lighthouse; pick another port (the same on every node), or stop that process"
            ) from None
        return None


def _status_page(address: str, timeout: float) -> str | None:
    """The lighthouse's status page at ``address`` (``http://HOST:PORT``), or ``None`` when nothing answers
    with one within ``timeout`` seconds."""
    try:
        page = urllib.request.urlopen(f"{address}/status", timeout=timeout).read(65536).decode(errors="replace")
    except (OSError, ValueError):
        return None
    return page if "heartbeating]" in page else None


def _serve_while_others_heartbeat(served: Lighthouse) -> None:
    """Keep ``served`` up while some replica group still heartbeats to it (read from its status page), for at
    most :data:`AFTER_OWN_GROUP_S` seconds."""
    deadline = time.monotonic() + AFTER_OWN_GROUP_S
    said = False
    while time.monotonic() < deadline:
        status = _status_page(served.address, timeout=5.0)
        if status is None:
            return
        found = re.search(r"\[(\d+) heartbeating\]", status)
        if found is None or found.group(1) == "0":
            return
        if not said:
            print(f"ddpkit: this node's group ended; the lighthouse serves the {found.group(1)} group(s) still "
                  "heartbeating until they end", file=sys.stderr, flush=True)  # fmt: skip
            said = True
        time.sleep(0.5)


def serve_until_interrupted(host: str, port: int, min_replicas: int = 1) -> int:
    """``ddpkit lighthouse``: serve torchft's lighthouse on ``host:port`` and the job's record on ``port + 1`` (signed
    with this process's job secret) until Ctrl-C or SIGTERM (status 0).

    Raises:
        PortTakenError: something listens on ``host:port`` already (a lighthouse a node's command serves, say).
    """
    try:
        served = serve_lighthouse(host, port, min_replicas=min_replicas)
    except RuntimeError as error:
        if "in use" not in str(error).lower():
            raise
        raise PortTakenError(
            f"port {port} of {host} is taken: another process serves it (the lighthouse of a node's `ddpkit run "
            "--fault-tolerance`, when it started first?). Pick another --port, or stop that process"
        ) from None
    with served:
        signed = "signed with the job secret" if job_secret() is not None else "without a job secret"
        print(f"ddpkit: torchft's lighthouse at {served.address}, the job's record at {served.record} ({signed}; "
              "Ctrl-C stops them)", file=sys.stderr, flush=True)  # fmt: skip
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
        finally:
            signal.signal(signal.SIGTERM, previous)


def _run_groups(start: StartGroup, groups: int, size: int, lighthouse: str, secret: bytes) -> list[int]:
    children = [_start_group(start, f"group-{i}", size, lighthouse, secret.decode(), groups, {}) for i in range(groups)]
    return _wait(children)


def _start_group(
    start: StartGroup, replica_id: str, size: int | None, lighthouse: str, secret: str, groups: int,
    more: dict[str, str],
) -> Child:  # fmt: skip
    variables = {LIGHTHOUSE_VARIABLE: lighthouse, REPLICA_ID_VARIABLE: replica_id, SECRET_VARIABLE: secret,
                 GROUPS_VARIABLE: str(groups), **more}  # fmt: skip
    return start(replica_id, size, variables)


def _wait(children: list[Child], warned: list[int] | None = None) -> list[int]:
    """Wait for every group; Ctrl-C or SIGTERM here stops them all, SIGUSR1 (SLURM's warning before the
    walltime) goes on to their agents, which hand it to their ranks (and into ``warned``). Their exit statuses."""

    def forward(signum: int, frame: object) -> None:
        if warned is not None:
            warned.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    before = signal.signal(signal.SIGUSR1, forward)
    try:
        return [child.wait() for child in children]
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            child.wait()
        return [130] * len(children)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGUSR1, before)
