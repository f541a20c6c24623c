"""One replica group of a fault-tolerant job: torchft's ``Manager``, its servers on one address."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ddpkit._gradients import reduce_gradients
from ddpkit._stores import release_store, serve_store
from ddpkit._trust.group_store import SignedStore
from ddpkit._trust.secret import GUIDE, SECRET_VARIABLE, job_secret
from ddpkit.collectives.objects import broadcast_object
from ddpkit.connection import group_context
from ddpkit.fault_tolerance._healing import TensorTransport
from ddpkit.fault_tolerance._manager import SeenQuorum, client_recording, manager_server_on, signed_group_store
from ddpkit.fault_tolerance._quorum_proof import claim_store, proven_gloo
from ddpkit.fault_tolerance._quorums import JobEnded, QuorumJudge, QuorumVerdicts, VerdictRelay, group_name
from ddpkit.fault_tolerance._record import (
    STALLED_S,
    JobRecord,
    LocalRecord,
    RecordUnreachableError,
    UnsignedRecordError,
    record_address,
)
from ddpkit.fault_tolerance._torchft import bracketed, local_address, torchft_module
from ddpkit.fault_tolerance._torchft_log import first_line, quiet_torchft
from ddpkit.process_group import get_rank, get_world_size

log = logging.getLogger(__name__)
_warned_without_secret = False
_warned_unsigned_record = False


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

    The job's progress outlives its groups: the lighthouse (:func:`serve_lighthouse`) keeps the job's record
    beside it (the highest step a quorum committed, the processes that hold that state, whether the job
    finished), which the first participant of each quorum updates after its commit. Each new quorum is judged
    against it before it trains: one whose groups are all behind the job (started again, or stalled while the
    others went on) asks again until a group that holds the job's state joins it, and takes the state from that
    group; only when every holder is gone (each back as a new process, or none within ``quorum_timeout``) does
    it go on from the newest state it has (a checkpoint's), and with none at all the job ends with the reason
    (:class:`JobEnded`, status 1), never silently from step 0. A group that starts or comes back after the job
    finished ends at once (status 0).

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
        quorum_timeout: seconds to wait for a quorum (default 60), and for a group that holds the job's state
            when the quorum is behind the job's record.
        replica_groups: how many groups the job starts; its first quorum (before any step was committed) waits,
            up to ``quorum_timeout``, until that many are in it (default ``None``: no wait).
        restarted: whether this process starts the group again (its launcher's restart, default ``False``): when
            no lighthouse answers it any more, the job is over (:class:`JobEnded`, status 0).
        step: the step this group starts at, in torchft's count (default 0): for a checkpoint of ``N`` training
            steps, ``N + 1`` (torchft counts the job's first quorum, which trains nothing).
        member_timeout: seconds a quorum's set-up waits for each member to join its process group (default 3;
            at least the lighthouse's heartbeat timeout): a member that died after it asked for the quorum costs
            the others this, not ``timeout``, before they ask for a quorum without it.

    Warns:
        RuntimeWarning: no job secret (once per process): any process that reaches the lighthouse can join.

    Raises:
        ImportError: torchft is not installed (the message says how to install it).
        RendezvousFailedError: no route from this machine to the lighthouse's host.
        RecordUnreachableError: no job's record answers beside the lighthouse (a first start).
        JobEnded: the job finished, or cannot go on, before this group joined it.
    """

    def __init__(
        self, lighthouse: str, replica_id: str, state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None], *, min_replicas: int = 1, timeout: float = 30.0,
        quorum_timeout: float = 60.0, replica_groups: int | None = None, restarted: bool = False, step: int = 0,
        member_timeout: float = 3.0,
    ) -> None:  # fmt: skip
        torchft = torchft_module()
        managers = torchft_module("torchft.manager")
        quiet_torchft()
        local = local_address(lighthouse)
        secret = job_secret()
        if secret is None:
            _warn_without_secret()
        #: The last quorum this group's client took: its replica ids (``NAME:uuid``) and highest step.
        self._seen = SeenQuorum()
        self._quorum: tuple[int, int | None, int | None] | None = None  # this step's (participants, rank, index)
        #: Why the last step was not committed, as far as this group saw (``Type: message``), else ``None``.
        self.failure: str | None = None
        self._replica_id, self._quorum_timeout = replica_id, quorum_timeout
        self._group = proven_gloo(secret, timeout, lambda: list(self._seen.ids), local, member_timeout, self._doomed)
        transport = TensorTransport(
            self._group, lambda: {"user": {"default": state_dict()}, "torchft": {"step": 0, "batches_committed": 0}},
            timeout,
        )  # fmt: skip
        #: This process's rank in its replica group, and the group's ranks (the default process group's).
        self.rank, self.ranks = get_rank(), get_world_size()
        self._record = _job_record(lighthouse, secret, timeout, restarted)
        self._judge: QuorumJudge | None = None
        self._store_port = serve_store(local, 0) if self.rank == 0 else None
        assert self.rank != 0 or self._store_port is not None, f"{local} is this machine's own address"
        store, ended = self._meet(local, step, replica_id, replica_groups, quorum_timeout)
        if ended is not None:
            release_store(self._store_port)
            self._record.close()
            raise JobEnded(*ended)
        signed: list[SignedStore] = []
        try:
            verdicts = QuorumVerdicts(self._judge, self._relay(store, secret, quorum_timeout))
            with (
                manager_server_on(managers, local),
                client_recording(managers, self._seen, replica_id, verdicts),
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
            if step > 0:  # a checkpoint's step: a quorum of groups that all started again goes on from the newest
                self._manager.load_state_dict({"step": step, "batches_committed": 0})
            #: This group's process as torchft names it in the quorums (``NAME:uuid``).
            self._process = _read_key(signed[0] if signed else store, managers.REPLICA_ID_KEY).decode()
            self._record.start_beating(self._process, self.rank)  # the others see that this rank is alive
            if secret is not None and self.rank == 0:  # the quorums' members check whose store it is
                claim_store(f"{bracketed(local)}:{self._store_port}", self._process, secret)
        except BaseException:
            release_store(self._store_port)
            self._record.close()
            raise

    def _meet(self, local: str, step: int, replica_id: str, replica_groups: int | None, quorum_timeout: float
              ) -> tuple[tuple[str, int | None], tuple[int, str] | None]:  # fmt: skip
        """The group's store (rank 0's, on ``local``) and, when the job's record says it ended, how; rank 0 reads
        the record (and judges this group's quorums from now on), the others take what it read (every rank)."""
        store, ended = (local, self._store_port), None
        if self.rank == 0:
            ended = QuorumJudge.ended(self._record.read(), step)
            self._judge = QuorumJudge(self._record, replica_id, start=step, replica_groups=replica_groups,
                                      quorum_timeout=quorum_timeout)  # fmt: skip
            self._record.update(lambda now: now.with_ranks(replica_id, self.ranks))  # the judges compare sizes
        if self.ranks > 1:  # the group's store is rank 0's; so is what the record said
            store, ended = broadcast_object((store, ended) if self.rank == 0 else None, src=0)
        return store, ended

    def _doomed(self, rank: int) -> str | None:
        """Why the quorum's collective in which rank ``rank`` of this group waits cannot complete, if it cannot: a
        member's same rank stopped beating in the job's record (stopped, or dead with its connections open), or
        the job's record went past this group's step (the others went on without it); else ``None``."""
        others = [member for member in self._seen.ids if member != getattr(self, "_process", None)]
        stalled = self._record.stalled(others, rank)
        if stalled:
            return f"{_names(stalled)} stopped (no beat for {STALLED_S:g} s): stopped, or dead"
        if self._record.read().step > self._seen.max_step + 1:  # a step after this quorum's was committed
            return "the other replica groups went on without this one (it was stopped, or fell behind)"
        return None

    def _relay(self, store: tuple[str, int | None], secret: bytes | None, quorum_timeout: float) -> VerdictRelay | None:
        """How rank 0's verdicts on the quorums reach the group's other ranks (``None`` for a group of one)."""
        if self.ranks == 1:
            return None
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        assert store[1] is not None
        client = TCPStore(store[0], store[1], is_master=False, timeout=timedelta(seconds=quorum_timeout + 30))
        return VerdictRelay(client, secret, f"{store[0]}:{store[1]}|{group_context()}", quorum_timeout + 30)

    @property
    def step(self) -> int:
        """Steps committed so far (a recovering group takes its peers' count)."""
        return int(self._manager.current_step())

    def _facts(self) -> tuple[int, int | None, int | None]:
        """The step's quorum: its participants, this group's participating rank and its index (``None`` while it
        recovers), asked of torchft once a step (each of its questions waits for the quorum again)."""
        if self._quorum is None:
            count, rank = int(self._manager.num_participants()), self._manager.participating_rank()
            index = None if rank is None or not self._manager.is_participating() else int(rank)
            self._quorum = (count, rank, index)
        return self._quorum

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum (waits for the quorum)."""
        return self._facts()[0]

    @property
    def participant_index(self) -> int | None:
        """This group's index among the quorum's participants, ``None`` while it is recovering (waits for the
        quorum). At the job's first quorum every group but one recovers from that one (torchft's ``init_sync``)
        and still counts in :attr:`participants`: their gradients are zeros in that step's average."""
        return self._facts()[2]

    @property
    def members(self) -> tuple[str, ...]:
        """The replica ids of the current step's quorum, recovering groups included, sorted (waits for the
        quorum)."""
        self._facts()
        return tuple(sorted(group_name(i) for i in self._seen.ids))

    @property
    def member_processes(self) -> tuple[str, ...]:
        """The current step's quorum as torchft names its members, ``NAME:uuid`` with a new uuid each time a
        group's process starts, sorted (waits for the quorum): a group started again shows here."""
        self._facts()
        return tuple(sorted(self._seen.ids))

    def start_step(self) -> None:
        """Ask for this step's quorum (before the forward pass); every group calls it at each step. The quorum is
        judged against the job's record before it trains (see the class's docstring); waiting for the job's first
        quorum, or for a holder of its state, happens there.

        Raises:
            JobEnded: (from the properties that wait for the quorum) the job finished, or cannot go on.
        """
        self._quorum = None
        self._manager.start_quorum()

    def average_gradients(self, parameters: Iterable[nn.Parameter], also: torch.Tensor | None = None, *,
                          sharded: bool = False, own: int = 0) -> bool:  # fmt: skip
        """Average the gradients of ``parameters`` over the group's ranks (when it has several) and then over the
        quorum's groups: one all-reduce of each per device and dtype; whether it went through.

        ``sharded`` (default ``False``): the gradients are a sharded model's, already averaged over the group's
        ranks by its reduce-scatter (FSDP's, each rank holding the mean of its shard): each rank averages its
        shards with the same rank of the other groups (HSDP across replica groups), and only ``also`` is
        averaged over the group's ranks first, except its first ``own`` numbers (default 0: this rank's own, such
        as its shards' norms, averaged with the same rank of the other groups only).

        A parameter without a gradient counts as zero (and gets one). ``also`` (optional, 1-D floating point,
        shape ``(n,)``: a few numbers such as loss sums) is averaged in place with the first of them, in its
        dtype. After a failure in this step the gradients (and ``also``) are left as they are, it returns
        ``False`` and so does :meth:`commit`. A recovering group adds zeros. Every rank of every group of the
        quorum calls it, after ``backward()`` (of a model without DDP's own all-reduce: outside
        ``DistributedDataParallel``, or inside its ``no_sync()``).

        Raises:
            RuntimeError: another rank of this group failed (torch's error): the group's launcher restarts it.
        """

        riding = [also.numel() - own if also is not None and sharded else 0]  # at the first flat tensor's end

        def mean(flat: torch.Tensor) -> bool:
            if self.ranks > 1:  # over this group's ranks first: a rank that died fails it here
                part = flat[flat.numel() - riding[0] :] if sharded else flat  # sharded: what rides alone
                riding[0] = 0
                if part.numel():
                    torch.distributed.all_reduce(part)
                    part.div_(self.ranks)
            self._manager.allreduce(flat).wait()  # the mean over the participants
            return self._manager.errored() is None

        return reduce_gradients(parameters, mean, also)

    def commit(self) -> bool:
        """Whether every group of the quorum finished this step: then (only then) take the optimizer step.
        Every group of the quorum calls it. When it is not, :attr:`failure` says why, as far as this group saw.
        The quorum's first participant notes the step in the job's record (in the background)."""
        error = self._manager.errored()
        self.failure = None if error is None else first_line(error.original_exception)
        committed = bool(self._manager.should_commit())
        if committed and self._judge is not None and self._facts()[1] == 0:
            self._record.note_commit(self._judge.generation, self.step, tuple(self._seen.ids))
        return committed

    def finish(self) -> None:
        """Record that the job's training is done at :attr:`step`: a group that starts or comes back after this,
        behind that step, trains nothing (it ends with status 0, saying so). Rank 0 writes; every rank may call it.

        Raises:
            RecordUnreachableError: the job's record is gone (with the lighthouse).
        """
        if self.rank != 0:
            return
        done = (self.step, self._replica_id)
        self._record.update(lambda now: None if now.finished or now.failed else replace(now, finished=done))

    def close(self) -> None:
        """Leave the job: stop the manager's server and the store."""
        self._manager.shutdown(wait=False)
        self._record.close()
        release_store(self._store_port)
        self._store_port = None


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


def _read_key(store: Any | tuple[str, int | None], key: str) -> bytes:
    """``key``'s value in the group's store (a store, or its ``(host, port)``)."""
    if isinstance(store, tuple):
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        host, port = store
        assert port is not None
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
    return bytes(store.get(key))


def _names(processes: list[str]) -> str:
    """``replica group NAME`` / ``replica groups A, B`` of torchft's ``NAME:uuid`` processes."""
    names = sorted({group_name(p) for p in processes})
    return f"replica group{'s' if len(names) > 1 else ''} {', '.join(names)}"


def _job_record(lighthouse: str, secret: bytes | None, timeout: float, restarted: bool) -> JobRecord | LocalRecord:
    """This process's connection to the job's record beside ``lighthouse``; where that record has no job secret
    and this process has one, a record of this process's own, after a warning (once per process).

    Raises:
        JobEnded: a group started again reaches no record: the lighthouse is gone with the job (status 0).
        RecordUnreachableError: a group's first start reaches none.
    """
    global _warned_unsigned_record
    try:
        return JobRecord(*record_address(lighthouse), secret, timeout=min(timeout, 30.0))
    except UnsignedRecordError as error:
        if not _warned_unsigned_record:
            _warned_unsigned_record = True
            log.warning(
                "%s: this replica group cannot trust it, and goes on without it: two groups lost together may then "
                "train steps again, and a stopped group costs the others the step's timeout. Give the lighthouse the "
                "job secret (ddpkit lighthouse --secret-file, or DDPKIT_JOB_SECRET where it runs); see %s",
                error, GUIDE,
            )  # fmt: skip
        return LocalRecord()
    except RecordUnreachableError as error:
        if restarted:
            raise JobEnded(0, f"started again, it reaches no lighthouse that answers ({error})") from None
        raise
