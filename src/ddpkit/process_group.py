"""The default process group as the rest of ddpkit sees it: ranks, world size, barriers, rank zero, seeding.

Every helper here is safe without a process group: ranks read 0, world sizes 1,
and barriers return at once, so the same code runs in one process. Creating and
destroying the group is :mod:`ddpkit.connection` (its names are re-exported here).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from ddpkit.connection import (
    SupportsClusterEnvironment,
    SupportsMainAddress,
    destroy_dist_connection,
    ensure_dist_connection,
    init_dist_connection,
    main_address_and_port,
)
from ddpkit.environments import detect_environment
from ddpkit.errors import DDPKitError
from ddpkit.hangs import _watchdog as watchdog

__all__ = [
    "SupportsClusterEnvironment",
    "SupportsMainAddress",
    "barrier",
    "collective_device",
    "destroy_dist_connection",
    "device_of_group",
    "ensure_dist_connection",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_dist_connection",
    "is_ddp",
    "is_distributed",
    "main_address_and_port",
    "rank_device",
    "rank_zero_first",
    "rank_zero_only",
    "seed_everything",
]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
_CPU = torch.device("cpu")


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def is_ddp() -> bool:
    """OML's name for :func:`is_distributed`: whether the default process group exists."""
    return is_distributed()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the default group); 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (default: the default group); 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_local_rank() -> int:
    """This process's rank on its node, from the cluster environment (0 for a lone process).

    Read from the environment variables (``LOCAL_RANK``, ``SLURM_LOCALID``, ...),
    so it is right before the process group exists too: use it to pick the CUDA
    device, ``torch.cuda.set_device(get_local_rank())``.
    """
    return detect_environment().local_rank()


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank of ``group`` reaches this call (every rank of it must call it).

    Returns at once without a process group. On NCCL the barrier runs on this
    rank's current CUDA device.

    Args:
        group: the process group; default the whole world.
    """
    if not is_distributed():
        return
    if dist.get_backend(group) == "nccl":
        dist.barrier(group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group)


def rank_device() -> torch.device:
    """The device this rank computes on: ``cuda:<local rank>`` (modulo the device count) with CUDA, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend communicates: CUDA for ``nccl``, else CPU.

    Cheap enough for every collective: the group's own name answers for plain
    backends (``dist.get_backend`` only for device-mapped groups).
    """
    if not is_distributed():
        return _CPU
    pg = group if group is not None else dist.group.WORLD
    return device_of_group(pg, group) if isinstance(pg, dist.ProcessGroup) else _CPU


def device_of_group(pg: dist.ProcessGroup, group: dist.ProcessGroup | None) -> torch.device:
    """:func:`collective_device` of a group already looked up (``pg``; ``group`` as the caller gave it)."""
    name = pg.name()
    nccl = name == "nccl" if name in ("gloo", "nccl", "mpi", "ucc") else dist.get_backend(group) == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else _CPU


def rank_zero_only(fn: Callable[P, T]) -> Callable[P, T | None]:
    """Decorator: call ``fn`` on global rank 0 only; other ranks get ``None``.

    The rank is the process group's when one exists, else the cluster
    environment's (so it is right in a torchrun worker before initialisation).

    Example:
        >>> @rank_zero_only
        ... def log_once(message: str) -> None:
        ...     print(message)
    """

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T | None:
        if _process_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapped


@contextmanager
def rank_zero_first(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the body on rank 0 of ``group`` first, then on the other ranks.

    For work that must happen once before the others read its result (download
    a data set, build a cache). Every rank of ``group`` must enter it. If rank 0
    raises inside the body, the other ranks are still released and raise
    :class:`~ddpkit.DDPKitError` carrying rank 0's error instead of running their
    body; nothing hangs. Costs one broadcast (two when rank 0 failed). Without a
    process group it just runs the body. The other ranks' wait does not count
    towards the hang timeout.

    Raises:
        DDPKitError: on ranks other than 0, when rank 0's body raised.
    """
    if not is_distributed():
        yield
        return
    device = collective_device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank(group) == 0:
        failure: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _send_status(failure, src, device, group)
    else:
        with watchdog.paused():  # rank 0 may take long (a download): waiting for it is not a hang
            error = _receive_status(src, device, group)
        if error is not None:
            raise DDPKitError(f"rank 0 failed inside rank_zero_first, so this rank did not run its body: {error}")
        yield


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device).

    Args:
        seed: in ``[0, 2**32)``.
        per_rank: add this process's global rank, so that ranks draw different
            numbers (e.g. for augmentation); the default gives every rank the same
            seed (e.g. for identical model initialisation).

    Returns:
        The seed used on this rank.

    Raises:
        ValueError: ``seed`` outside ``[0, 2**32)``.
    """
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    used = (seed + _process_rank()) % 2**32 if per_rank else seed
    random.seed(used)
    np.random.seed(used)
    torch.manual_seed(used)
    return used


# --- helpers ----------------------------------------------------------------------


def _process_rank() -> int:
    return dist.get_rank() if is_distributed() else detect_environment().global_rank()


def _send_status(
    failure: BaseException | None, src: int, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    message = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:65536]
    status = torch.tensor([int(failure is not None), len(message)], dtype=torch.int64, device=device)
    try:
        dist.broadcast(status, src=src, group=group)
        if failure is not None:
            payload = torch.tensor(list(message) or [0], dtype=torch.uint8, device=device)
            dist.broadcast(payload, src=src, group=group)
    except Exception:
        if failure is None:
            raise
        log.exception("rank_zero_first: could not tell the other ranks that rank 0 failed")


def _receive_status(src: int, device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    status = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(status, src=src, group=group)
    if not int(status[0]):
        return None
    payload = torch.zeros(max(int(status[1]), 1), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return bytes(payload[: int(status[1])].tolist()).decode(errors="replace")
