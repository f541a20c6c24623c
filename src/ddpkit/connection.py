"""Create and destroy the default process group: ``init_dist_connection`` (Lightning's) and its helpers.

From a cluster environment (ddpkit's, Lightning's 1.x or 2.x, or anything with
their methods) to ``torch.distributed.init_process_group``: the rank, world
size, master address and port, the backend (NCCL for a rank that owns a GPU,
else gloo), a master address checked to resolve, a store bound to loopback when
the master is loopback, torch's flight recorder and ddpkit's hang watchdog for
jobs of several processes.
"""

from __future__ import annotations

import atexit
import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._backends import pin_gloo_to_loopback, resolve_backend
from ddpkit._stores import release_store, serve_store
from ddpkit._torch_private import default_store
from ddpkit._trust.group_proof import PROOF_COLLECTIVES, prove_members
from ddpkit._trust.group_store import SignedStore, agree_on_group_id, default_group_context, gloo_addresses
from ddpkit._trust.sealed import SealedKeys
from ddpkit._trust.secret import job_secret
from ddpkit.environments import LocalEnvironment, detect_environment, is_loopback, launched_environment
from ddpkit.environments.base import check_resolves
from ddpkit.environments.lightning_shapes import (
    SupportsClusterEnvironment,
    SupportsMainAddress,
    main_address_and_port,
    optional_int_method,
)
from ddpkit.errors import ClusterEnvironmentError, DDPKitError
from ddpkit.hangs import _watchdog as watchdog

__all__ = [
    "SupportsClusterEnvironment",
    "SupportsMainAddress",
    "destroy_dist_connection",
    "ensure_dist_connection",
    "group_context",
    "group_keys",
    "init_dist_connection",
    "main_address_and_port",
]

log = logging.getLogger(__name__)

#: The default group's signed store (with a job secret), kept alive for torch (see :func:`_signed_store`).
_signed: SignedStore | None = None
#: What the default group that this module made is (its members proved the secret for it); ``None``: none made.
_context: str | None = None
#: How many default groups this process made on a signed store (each signs its id under a key of its own).
_groups_made = 0
#: The port of the loopback store this process hosts for the default group (rank 0), if any.
_served_port: int | None = None
#: The default group :func:`ensure_dist_connection` created, destroyed at exit if still there.
_ensured_group: Any = None

#: torch's shortest default process-group timeout (NCCL's 10 minutes; gloo's is 30).
_SHORTEST_DEFAULT_TIMEOUT_S = 600


def init_dist_connection(
    cluster_environment: SupportsClusterEnvironment | SupportsMainAddress | None = None,
    torch_distributed_backend: str | None = None,
    global_rank: int | None = None,
    world_size: int | None = None,
    *,
    hang_timeout: float | None = None,
    **kwargs: Any,
) -> None:
    """Initialise the default process group from a cluster environment (Lightning's ``init_dist_connection``).

    Sets ``MASTER_ADDR`` and ``MASTER_PORT`` from the environment, then calls
    :func:`torch.distributed.init_process_group`. Every rank of the job must call
    it. Calling it again once a group exists does nothing (but an explicit
    ``global_rank`` or ``world_size`` that contradicts the existing group raises).

    Args:
        cluster_environment: where this process sits; ``None`` means
            :func:`~ddpkit.detect_environment`. Any object with
            ``master_address()``, ``master_port()`` and ``world_size()`` works
            (Lightning 1.x), or with ``main_address`` and ``main_port``
            properties and ``world_size()`` (Lightning 1.6+ and 2.x, e.g.
            ``lightning.fabric.plugins.environments.SLURMEnvironment()``);
            ``global_rank()`` and ``local_rank()`` are used when it has them.
        torch_distributed_backend: ``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``,
            ``"xccl"``, a device map such as ``"cpu:gloo,cuda:nccl"``, or
            ``None``/``"auto"``: ``nccl`` when this rank owns a CUDA device (its
            local rank is below the device count), else ``gloo``.
        global_rank: this process's rank; default the environment's.
        world_size: number of processes; default the environment's.
        hang_timeout: seconds a rank may wait in one collective before the job
            counts as hung (default ``DDPKIT_HANG_TIMEOUT``, else 300; ``0``
            turns the watchdog off). With several processes a watchdog thread
            then watches every collective of this process (torch's flight
            recorder is turned on for it); past the deadline every rank's state
            and stack go into one report and the job stops (see the
            documentation's page on hangs, ``docs/hangs.md``). The process group's own ``timeout`` defaults to
            at least this plus 60 s, so that the report comes first.
        **kwargs: forwarded to ``init_process_group``, e.g. ``timeout`` (a
            ``timedelta``, or a number of seconds) or ``init_method``.

    Rank 0 hosts the store on the master address alone when that is a loopback
    name or an IP address of this machine (torch's own would listen on every
    interface; a host name is left to torch, since the address the other
    machines resolve it to is not known here). When the master address is
    loopback, gloo is also pinned to the loopback interface unless
    ``GLOO_SOCKET_IFNAME`` is set, so nothing listens beyond this machine.

    With a job secret, every value a rank writes to the group's store is
    signed with it and every value read must be (so nobody can give the
    ranks its own address in place of a rank's, and relay between them), and
    every rank proves right after the group is made that it holds the secret
    (a challenge and response over the group's own connections, two
    all-gathers of 32 bytes), so that a program outside the job that took a
    rank's place is found before any of the job's data moves. A ``store``
    passed in ``kwargs`` is used as it is (not signed).

    Raises:
        RuntimeError: ``torch.distributed`` is not available in this build.
        ValueError: an unknown or unavailable backend (the message lists the valid
            ones), ``nccl`` without a CUDA device, or a rank outside
            ``[0, world_size)``.
        ClusterEnvironmentError: several processes but no ``MASTER_PORT`` they
            could agree on, inconsistent environment variables, or a master
            address that does not resolve (naming it and where it came from).
        DDPKitError: a group exists with a different rank or world size.
        GroupProofError: with a job secret (``DDPKIT_JOB_SECRET``, or
            ``ddpkit run --secret-file``), an address in the group's store was
            not signed with it (the group was not made), or a member of the new
            group could not prove that it holds it (the group was destroyed);
            either way before any data moved through it.
    """
    if not dist.is_available():
        raise RuntimeError(
            "torch.distributed is not available in this PyTorch build; install a build with "
            "distributed support (the standard Linux and macOS wheels have it)"
        )
    if dist.is_initialized():
        _check_matches_existing_group(global_rank, world_size)
        log.debug("init_dist_connection: the default process group already exists")
        return

    env = cluster_environment if cluster_environment is not None else detect_environment()
    rank, size, local_rank = _place(env, global_rank, world_size)
    backend = resolve_backend(torch_distributed_backend, local_rank)
    address, port = main_address_and_port(env)
    source = getattr(env, "master_address_source", None)
    check_resolves(address, source() if callable(source) else f"the master address of {type(env).__name__}")
    deadline = watchdog.hang_timeout(hang_timeout) if size > 1 else None
    if deadline is not None:
        watchdog.enable_flight_recorder()
        if "timeout" not in kwargs and deadline + 60 > _SHORTEST_DEFAULT_TIMEOUT_S:
            kwargs["timeout"] = deadline + 60
    os.environ["MASTER_ADDR"] = address
    os.environ["MASTER_PORT"] = str(port)
    if "gloo" in backend and is_loopback(address):
        pin_gloo_to_loopback()
    if "nccl" in backend:
        torch.cuda.set_device(local_rank)
    if isinstance(kwargs.get("timeout"), (int, float)):
        kwargs["timeout"] = timedelta(seconds=kwargs["timeout"])
    global _served_port
    if rank == 0 and "init_method" not in kwargs and "store" not in kwargs:
        # Else torch's store listens on every interface. A port held already is left to torch: its
        # own server in this process, or its error; so is a host name.
        _served_port = serve_store(address, port, if_taken="torch")
    secret = job_secret()
    proved = secret is not None and size > 1
    # What the group is, the same text on every rank: the store the ranks meet at, the job and its attempt (and,
    # once its rank 0 drew it, the group's own id).
    context = default_group_context(address, port)
    log.info("initialising process group: rank %d of %d, backend %s, master %s:%d", rank, size, backend, address, port)
    try:
        if proved and "store" not in kwargs:
            assert secret is not None
            kwargs["store"], context = _signed_store(secret, context, rank, size, kwargs, f"{address}:{port}")
        dist.init_process_group(backend, rank=rank, world_size=size, **kwargs)
    except BaseException:
        release_store(_served_port)
        _served_port = None
        raise
    if proved:
        assert secret is not None
        _prove_members(secret, context)
    global _context
    _context = context
    world = dist.group.WORLD
    if world is not None:  # the hang report numbers the user's collectives from 1
        watchdog.count_own_collectives(world.group_name, PROOF_COLLECTIVES if proved else 0)
    if deadline is not None:
        watchdog.start_watchdog(deadline, context=context)


def _place(
    env: SupportsClusterEnvironment | SupportsMainAddress, global_rank: int | None, world_size: int | None
) -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` of this process in ``env`` (``global_rank``, ``world_size``: given in
    its place), checked.

    Raises:
        TypeError: ``env`` has no ``global_rank()`` and none was given.
        ValueError: the rank is outside ``[0, world_size)``.
        ClusterEnvironmentError: several processes, but no ``MASTER_PORT`` they could agree on.
    """
    rank = optional_int_method(env, "global_rank", global_rank)
    size = int(env.world_size()) if world_size is None else int(world_size)
    if rank is None:
        raise TypeError(f"{type(env).__name__} has no global_rank() method; pass global_rank= to init_dist_connection")
    if not 0 <= rank < size:
        raise ValueError(f"global_rank={rank} must be in [0, world_size={size})")
    if size > 1 and isinstance(env, LocalEnvironment) and env.port_was_chosen:
        found = f"WORLD_SIZE={size}, RANK={rank}" if world_size is None else f"world_size={size}, rank={rank}"
        raise ClusterEnvironmentError(
            f"{found}, but MASTER_PORT is not set, so each process would pick its own port and wait for the "
            "others forever; set MASTER_ADDR and MASTER_PORT in every process, or start them with `ddpkit run`, "
            "torchrun or ddpkit.launch()"
        )
    return rank, size, optional_int_method(env, "local_rank", None) or 0


def _signed_store(
    secret: bytes, context: str, rank: int, size: int, kwargs: dict[str, Any], where: str
) -> tuple[Any, str]:
    """The store ``init_process_group`` would meet at (its ``init_method``, by default ``env://``: under torchrun
    the agent's store), as a :class:`~ddpkit._trust.group_store.SignedStore`, and the group's context with its id.

    Rank 0 first draws the group's id and signs it into the store
    (:func:`~ddpkit._trust.group_store.agree_on_group_id`); then every value a rank
    writes there (gloo's and NCCL's addresses first) is signed with the job
    secret for this group, and a value nobody with the secret wrote for it is
    refused when read, so that nobody who reaches the store can put its own
    address in place of a rank's, or one from an earlier job, and relay
    between the ranks."""
    global _signed, _groups_made
    timeout = kwargs.get("timeout") or dist.default_pg_timeout
    store, _, _ = next(
        dist.rendezvous(  # type: ignore[attr-defined]
            kwargs.pop("init_method", "env://"), rank, size, timeout=timeout
        )
    )
    store.set_timeout(timeout)
    base = dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]
    group = agree_on_group_id(base, rank, size, context, secret, timeout.total_seconds(), where, _groups_made)
    _groups_made += 1
    context = f"{context}|{group}"

    def name_key(key: str) -> str:
        last = key.rpartition("/")[2]
        if "//cpu//" in key and last.isdigit():  # gloo: "<group>//cpu//<device>/<rank>"
            return f"the gloo address of rank {last} (the key {key!r})"
        return f"the value of the key {key!r}"

    # The keys torch's own env:// gives the default group ("default_pg/..."), so nothing else on the store
    # meets them. The Python object is kept: torch holds only its C++ part, which cannot call its methods alone.
    _signed = SignedStore(base, secret, context, name_key)
    return _signed, context


def _prove_members(secret: bytes, context: str) -> None:
    """Every rank of the new default group proves that it holds the job secret; else the group is destroyed here.

    The proof is bound to ``context`` (the store the ranks met at, the job's run id and attempt: torchrun's), so
    that a proof made for another group, job or attempt does not verify.
    """
    global _served_port
    try:
        listen = _signed.addresses if _signed is not None and _signed.context == context else None
        prove_members(None, context, secret, addresses=gloo_addresses, listen=listen)
    except BaseException:
        dist.destroy_process_group()
        release_store(_served_port)
        _served_port = None
        raise
    log.info("every rank of the default group proved that it holds the job secret")


def group_context() -> str:
    """What the default process group is, as its members proved the job secret for it when this module made it
    (the job, its attempt, its store and the id its rank 0 drew), else as its variables say
    (:func:`~ddpkit._trust.group_store.default_group_context`): the same text on every rank, for signatures."""
    return _context if _context is not None else default_group_context()


def group_keys(prefix: str) -> SealedKeys:
    """The default group's own keys under ``prefix`` in its store: signed for the group (and sealed where asked)
    with the job secret, so that what a stranger writes there reads as absent (see :class:`~ddpkit._trust.sealed.
    SealedKeys`). The group must exist.

    Raises:
        RuntimeError: there is no default process group.
    """
    if not dist.is_initialized():
        raise RuntimeError("group_keys needs the default process group")
    store = dist.PrefixStore(prefix, default_store())  # type: ignore[attr-defined]
    return SealedKeys(store, job_secret(), group_context())


def ensure_dist_connection() -> bool:
    """Create the default process group if a launcher started this process as one of several ranks.

    The rule every ddpkit entry point applies before it decides that it runs
    alone (``TrainLoop.fit``, ``DDPHandler.add_distributed_samplers``,
    ``patch_dataloader_to_ddp``, the samplers and streams when they need a
    world size), as Lightning's ``Trainer`` and Accelerate's ``Accelerator``
    do: when torchrun, ``ddpkit run``, ``srun``, ``mpirun``, a Kubeflow or LSF
    job (or ``RANK`` and ``WORLD_SIZE`` set by hand) started this process as
    one rank of a job of several, and no default process group exists yet,
    create it with :func:`init_dist_connection` (so the hang watchdog comes
    with it). It stays until :func:`destroy_dist_connection` or the end of the
    process. A group that exists is used as it is, however it was made
    (``init_process_group(rank=..., world_size=...)`` included). A process
    alone (``python train.py``, one SLURM task, ``WORLD_SIZE=1``) gets no group.

    Every rank of the job must call it when it creates the group (the entry
    points above are called on every rank).

    Returns:
        Whether a default process group exists afterwards.

    Raises:
        ClusterEnvironmentError: the launcher's variables are half-set or
            contradictory, or the group cannot be made from them; the message
            names the variables found (e.g. ``WORLD_SIZE=2, RANK=1, but
            MASTER_PORT is not set``) and the fix.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    environment = launched_environment()
    if environment is None:
        return False
    if not dist.is_available():
        raise RuntimeError(
            f"{environment.name} started this process as rank {environment.global_rank()} of "
            f"{environment.world_size()}, but torch.distributed is not available in this PyTorch build"
        )
    log.info(
        "joining the %s job as rank %d of %d", environment.name, environment.global_rank(), environment.world_size()
    )
    init_dist_connection(environment)
    global _ensured_group
    if _ensured_group is None:
        atexit.register(_destroy_ensured_group)
    _ensured_group = dist.group.WORLD
    return True


def _destroy_ensured_group() -> None:
    """At exit, destroy the group :func:`ensure_dist_connection` made, unless the program destroyed it (NCCL
    warns about a group left)."""
    if _ensured_group is not None and dist.is_initialized() and dist.group.WORLD is _ensured_group:
        destroy_dist_connection()


def destroy_dist_connection() -> None:
    """Destroy the default process group, if there is one (every rank must call it); stop its hang watchdog."""
    global _served_port, _context
    watchdog.stop_watchdog()
    _context = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    release_store(_served_port)
    _served_port = None


def _check_matches_existing_group(global_rank: int | None, world_size: int | None) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    if (global_rank is not None and global_rank != rank) or (world_size is not None and world_size != size):
        raise DDPKitError(
            f"the default process group already exists as rank {rank} of {size}, but init_dist_connection "
            f"was asked for global_rank={global_rank}, world_size={world_size}; call destroy_dist_connection() first"
        )
