"""One replica group of a fault-tolerant job: torchft's ``Manager``, its servers on one address."""

from __future__ import annotations

import logging
import re
import time
import warnings
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ddpkit._gradients import reduce_gradients
from ddpkit._group_store import SignedStore
from ddpkit._secret import GUIDE, SECRET_VARIABLE, job_secret
from ddpkit._stores import release_store, route_address, serve_store
from ddpkit.collectives.objects import broadcast_object
from ddpkit.connection import group_context
from ddpkit.environments.base import is_loopback
from ddpkit.errors import DDPKitError, RendezvousFailedError
from ddpkit.fault_tolerance._healing import TensorTransport
from ddpkit.fault_tolerance._manager import client_recording, manager_server_on, signed_group_store
from ddpkit.fault_tolerance._quorum_proof import claim_store, proven_gloo
from ddpkit.fault_tolerance._torchft import bracketed, torchft_module, url_host
from ddpkit.process_group import get_rank, get_world_size

log = logging.getLogger(__name__)
_warned_without_secret = False


class ReplicaGroup:
    """This process as one replica group of a fault-tolerant job (torchft's ``Manager``), or as one rank of it
    when the default process group has several ranks: then that process group is the replica group (its
    rank 0 hosts the group's store and torchft's manager server; every rank of it constructs a ``ReplicaGroup``
    with the same arguments, and calls every method below in the same order).

    Every optimizer step, in this order: :meth:`start_step` (asks for the step's quorum; it is formed while
    the forward and backward run), :meth:`average_gradients` after ``backward()``, then :meth:`commit`, and
    ``optimizer.step()`` only when it returns ``True``. A step that failed in any group (a lost peer, a
    timeout) is committed in none; the groups that are left go on with the next quorum in the same
    processes. A group that joins late or comes back takes ``state_dict()`` from a healthy peer through
    ``load_state_dict`` before its first step counts.

    Its servers listen on one address: its store and torchft's manager server on 127.0.0.1 when the
    lighthouse is on loopback, else on this machine's address on its route to the lighthouse (rank 0's,
    for a group of several ranks).

    A group of several ranks averages the gradients over its own ranks (the default process group) and then
    over the quorum's groups, rank ``r`` of each group with rank ``r`` of the others (one process group of
    the quorum per rank of a group, as torchft's HSDP does); it commits a step only when every one of its
    ranks can. A rank that dies fails its group's collectives: its launcher restarts the whole group, which
    comes back and takes its peers' state, while the other groups go on. Run such a group under an agent that
    stops the other ranks when one dies (``ddpkit run``, torchrun): otherwise its rank 0's torchft manager keeps
    the group in the quorum's view while it waits for the dead rank, and holds the other groups back for up to
    ``quorum_timeout``.

    With a job secret (``DDPKIT_JOB_SECRET``, which ``ddpkit run --fault-tolerance`` and ``fit_distributed``
    give every group of a job), each quorum's members prove that they hold it before anything moves between
    them: a member that cannot (a process outside the job that asked the lighthouse for a quorum, or a group
    given another secret) gets no state and gives no gradient; the step fails in every group and the next
    quorums go on without it once the lighthouse drops it. Without a secret it warns once. A recovering group
    receives the state as tensors and plain values over the groups' process group, checked against its own
    state's shapes and dtypes; nothing a peer sends is unpickled.

    Args:
        lighthouse: the lighthouse's address, ``http://HOST:PORT`` (:attr:`Lighthouse.address`).
        replica_id: this group's name in the quorum; a group started again keeps its name.
        state_dict: what a recovering peer takes from this group (model, optimizer, loop state).
        load_state_dict: puts a healthy peer's ``state_dict()`` into this group.
        min_replicas: the fewest groups a step may commit with (default 1).
        timeout: seconds a collective or a recovery may take before the step fails (default 30).
        quorum_timeout: seconds to wait for a quorum (default 60).
        replica_groups: how many groups the job starts; its first step (every group of the quorum at step 0)
            waits, up to ``quorum_timeout``, until that many are in the quorum (default ``None``: no wait).
        restarted: whether this process starts the group again (its launcher's restart, default ``False``).
            With ``replica_groups`` above 1 its first step does not wait for the job's groups but for one other
            group to take the run's state from, up to ``quorum_timeout``; :attr:`alone` says when none came.

    Warns:
        RuntimeWarning: no job secret (once per process): any process that reaches the lighthouse can join.

    Raises:
        ImportError: torchft is not installed (the message says how to install it).
        RendezvousFailedError: no route from this machine to the lighthouse's host.
    """

    def __init__(
        self, lighthouse: str, replica_id: str, state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None], *, min_replicas: int = 1, timeout: float = 30.0,
        quorum_timeout: float = 60.0, replica_groups: int | None = None, restarted: bool = False,
    ) -> None:  # fmt: skip
        torchft = torchft_module()
        managers = torchft_module("torchft.manager")
        _quiet_torchft()
        local = local_address(lighthouse)
        secret = job_secret()
        if secret is None:
            _warn_without_secret()
        #: The replica ids of the last quorum, as this group's client received them (``NAME:uuid``).
        self._quorum_ids: list[str] = []
        #: Why the last step was not committed, as far as this group saw (``Type: message``), else ``None``.
        self.failure: str | None = None
        self._replica_id, self._quorum_timeout = replica_id, quorum_timeout
        #: The groups that its first step waits for (a restarted group: itself and one to take the state from);
        #: ``None`` once it has started.
        self._starting = (
            (2 if restarted else replica_groups) if replica_groups is not None and replica_groups > 1 else None
        )
        self._restarted = restarted
        #: Whether this group, started again, found no other group of the job within ``quorum_timeout`` at its
        #: first step: the job finished, or its other groups are gone, and no peer holds the run's state.
        self.alone = False
        self._group = proven_gloo(secret, timeout, lambda: list(self._quorum_ids), local)
        transport = TensorTransport(
            self._group, lambda: {"user": {"default": state_dict()}, "torchft": {"step": 0, "batches_committed": 0}},
            timeout,
        )  # fmt: skip
        #: This process's rank in its replica group, and the group's ranks (the default process group's).
        self.rank, self.ranks = get_rank(), get_world_size()
        self._store_port = serve_store(local, 0) if self.rank == 0 else None
        assert self.rank != 0 or self._store_port is not None, f"{local} is this machine's own address"
        store = (local, self._store_port)
        if self.ranks > 1:  # the group's store is rank 0's
            store = broadcast_object(store if self.rank == 0 else None, src=0)
        signed: list[SignedStore] = []
        try:
            with (
                manager_server_on(managers, local),
                client_recording(managers, self._quorum_ids, replica_id),
                signed_group_store(managers, secret, f"torchft group store|{store[0]}:{store[1]}|{group_context()}",
                                    signed),
            ):  # fmt: skip
                self._manager = torchft.Manager(
                    pg=self._group, min_replica_size=min_replicas, load_state_dict=load_state_dict,
                    state_dict=state_dict, replica_id=replica_id, store_addr=store[0], store_port=store[1],
                    rank=self.rank, world_size=self.ranks, lighthouse_addr=lighthouse, hostname=local,
                    timeout=timedelta(seconds=timeout), quorum_timeout=timedelta(seconds=quorum_timeout),
                    connect_timeout=timedelta(seconds=timeout), checkpoint_transport=transport,
                )  # fmt: skip
            if secret is not None and self.rank == 0:  # the quorums' members check whose store it is
                replica = signed[0].get(managers.REPLICA_ID_KEY).decode()
                claim_store(f"{bracketed(local)}:{self._store_port}", replica, secret)
        except BaseException:
            release_store(self._store_port)
            raise

    @property
    def step(self) -> int:
        """Steps committed so far (a recovering group takes its peers' count)."""
        return int(self._manager.current_step())

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum (waits for the quorum)."""
        return int(self._manager.num_participants())

    @property
    def participant_index(self) -> int | None:
        """This group's index among the quorum's participants, ``None`` while it is recovering (waits for the
        quorum). At the job's first quorum every group but one recovers from that one (torchft's ``init_sync``)
        and still counts in :attr:`participants`: their gradients are zeros in that step's average."""
        rank = self._manager.participating_rank()
        return None if rank is None or not self._manager.is_participating() else int(rank)

    @property
    def members(self) -> tuple[str, ...]:
        """The replica ids of the current step's quorum, recovering groups included, sorted (waits for the
        quorum)."""
        self._manager.wait_quorum()
        return tuple(sorted(group_name(i) for i in self._quorum_ids))

    @property
    def member_processes(self) -> tuple[str, ...]:
        """The current step's quorum as torchft names its members, ``NAME:uuid`` with a new uuid each time a
        group's process starts, sorted (waits for the quorum): a group started again shows here."""
        self._manager.wait_quorum()
        return tuple(sorted(self._quorum_ids))

    def start_step(self) -> None:
        """Ask for this step's quorum (before the forward pass); every group calls it at each step. At the job's
        first step with ``replica_groups``, ask again until that many groups are in the quorum."""
        self._manager.start_quorum()
        if self._starting is not None:
            came = self._wait_for_the_job(self._starting)
            self.alone = self._restarted and not came
            self._starting = None

    def _wait_for_the_job(self, groups: int) -> bool:
        """While every member of the quorum is at step 0 and fewer than ``groups`` are in it, drop the quorum
        (nothing committed) and ask again, for at most ``quorum_timeout``: a group that started first would
        otherwise train alone steps that the others, once they joined, would do again. Whether they came."""
        deadline = time.monotonic() + self._quorum_timeout
        while self._members_or_none() < groups and self.step == 0:
            if time.monotonic() > deadline:
                if not self._restarted:
                    log.warning(
                        "replica group %s: the job starts with %d of its %d replica groups (%s): the others did not "
                        "join within %g s (quorum_timeout)", self._replica_id, len(self.members), groups,
                        ", ".join(self.members), self._quorum_timeout,
                    )  # fmt: skip
                return False
            time.sleep(0.05)
            self._manager.start_quorum()  # the quorum above is left without a commit: its step 0 stays 0
        return True

    def _members_or_none(self) -> int:
        """How many groups the quorum holds; 0 for a group started again that no quorum answers at all (the
        lighthouse is gone with the job: asked several times, ``quorum_timeout`` each).

        Raises:
            TimeoutError: no quorum, in a group's first start (the lighthouse is not there yet, or unreachable).
            RuntimeError: torchft's transport error in a group's first start (the same, as its client says it).
        """
        try:
            return len(self.members)
        except (TimeoutError, RuntimeError) as exc:  # RuntimeError: torchft's "transport error" (lighthouse gone)
            if not self._restarted or (isinstance(exc, RuntimeError) and "transport error" not in str(exc)):
                raise
            log.warning("replica group %s: started again, it reaches no lighthouse that answers", self._replica_id)
            return 0

    def average_gradients(self, parameters: Iterable[nn.Parameter], also: torch.Tensor | None = None) -> bool:
        """Average the gradients of ``parameters`` over the group's ranks (when it has several) and then over the
        quorum's groups: one all-reduce of each per device and dtype; whether it went through.

        A parameter without a gradient counts as zero (and gets one). ``also`` (optional, 1-D floating point,
        shape ``(n,)``: a few numbers such as loss sums) is averaged in place with the first of them, in its
        dtype. After a failure in this step the gradients (and ``also``) are left as they are, it returns
        ``False`` and so does :meth:`commit`. A recovering group adds zeros. Every rank of every group of the
        quorum calls it, after ``backward()`` (of a model without DDP's own all-reduce: outside
        ``DistributedDataParallel``, or inside its ``no_sync()``).

        Raises:
            RuntimeError: another rank of this group failed (torch's error): the group's launcher restarts it.
        """

        def mean(flat: torch.Tensor) -> bool:
            if self.ranks > 1:  # over this group's ranks first: a rank that died fails it here
                torch.distributed.all_reduce(flat)
                flat.div_(self.ranks)
            self._manager.allreduce(flat).wait()  # the mean over the participants
            return self._manager.errored() is None

        return reduce_gradients(parameters, mean, also)

    def commit(self) -> bool:
        """Whether every group of the quorum finished this step: then (only then) take the optimizer step.
        Every group of the quorum calls it. When it is not, :attr:`failure` says why, as far as this group saw."""
        error = self._manager.errored()
        self.failure = None if error is None else _first_line(error.original_exception)
        return bool(self._manager.should_commit())

    def close(self) -> None:
        """Leave the job: stop the manager's server and the store."""
        self._manager.shutdown(wait=False)
        release_store(self._store_port)
        self._store_port = None


class _QuietTorchft(logging.Filter):
    """torchft's manager log, one line per event: a failed step's exception (torchft logs it with its
    traceback, in every group, at every failure) goes to ddpkit's log at DEBUG, since :meth:`ReplicaGroup.commit`
    keeps its first line for the group's own "step N was not committed" warning, except ddpkit's own errors
    (a member of the quorum that cannot prove the job secret, named), which keep their line without the
    traceback; and, on a torch without NCCL
    (a CPU build), the "Unable to reset NCCL flight recorder" warning that every group prints at every new
    quorum is dropped: there is no flight recorder to reset."""

    def __init__(self, nccl: bool) -> None:
        super().__init__()
        self.nccl = nccl

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.levelno >= logging.ERROR:
            log.debug("torchft: %s", record.getMessage(), exc_info=record.exc_info)
            if not isinstance(record.exc_info[1], DDPKitError):
                return False
            record.exc_info = record.exc_text = None  # who failed the proof, in one line
        return self.nccl or "Unable to reset NCCL flight recorder" not in record.getMessage()


def _first_line(error: BaseException) -> str:
    """``Type: message``, its first line without gloo's source location, at most 200 characters."""
    message = re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ", "", str(error).strip().partition("\n")[0])
    text = f"{type(error).__name__}: {message}"
    return text if len(text) <= 200 else text[:197] + "..."


def _quiet_torchft() -> None:
    """Install :class:`_QuietTorchft` on torchft's manager logger, once."""
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _QuietTorchft) for f in logger.filters):
        logger.addFilter(_QuietTorchft(torch.distributed.is_nccl_available()))


def _warn_without_secret() -> None:
    global _warned_without_secret
    if _warned_without_secret:
        return
    _warned_without_secret = True
    warnings.warn(
        f"this replica group has no job secret (${SECRET_VARIABLE}): any process that reaches the lighthouse can "
        "join the quorum, take the run's state and add its gradients. Start the job with ddpkit run "
        f"--fault-tolerance (which gives its groups one), or give every group the same secret; see {GUIDE}",
        RuntimeWarning,
        stacklevel=4,
    )


def local_address(lighthouse: str) -> str:
    """Where a group's servers listen: loopback with a lighthouse on loopback, else this machine's address on its
    route to the lighthouse.

    Raises:
        RendezvousFailedError: no route from this machine to the lighthouse's host.
    """
    host = url_host(lighthouse)
    if is_loopback(host):
        return "127.0.0.1"
    address = route_address(host)
    if address is None:
        raise RendezvousFailedError(
            f"no route from this machine to the lighthouse at {lighthouse}: check its address and the network"
        )
    return address


def group_name(replica_id: str) -> str:
    """A quorum member's replica id without the ``:uuid`` that torchft appends for each process."""
    return replica_id.rpartition(":")[0] or replica_id
