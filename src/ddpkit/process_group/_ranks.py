"""Ranks, world sizes, barriers and devices of the default process group (or of another group).

Every helper here is safe without a process group: ranks read 0, world sizes 1,
and barriers return at once, so the same code runs in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.environments import detect_environment

__all__ = [
    "barrier",
    "collective_device",
    "device_of_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_ddp",
    "is_distributed",
    "process_rank",
    "rank_device",
]

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


def process_rank() -> int:
    """This process's global rank: the process group's when one exists, else the cluster environment's."""
    return dist.get_rank() if is_distributed() else detect_environment().global_rank()
