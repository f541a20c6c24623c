"""What the collectives need to know of a process group, looked up once per call (private)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ddpkit.process_group import device_of_group, is_distributed

__all__ = ["GroupInfo"]

_CPU = torch.device("cpu")


def _nothing() -> None:
    return None


class GroupInfo(NamedTuple):
    """What the collectives need to know about a process group, looked up once per call (immutable, and cheap to
    build: it is built on every collective).

    Attributes:
        group: the group as the caller gave it (``None``: the default group).
        distributed: whether a process group exists at all.
        world_size, rank: of this process in ``group``.
        device: where the group's collectives take their tensors (:func:`~ddpkit.process_group.collective_device`).
        gloo: the group is torch's gloo backend itself, whose ``all_to_all`` moves a few KiB to every rank in
            half the time of its ``all_gather`` (the records go that way; other backends' ``all_gather``).
    """

    group: dist.ProcessGroup | None
    distributed: bool
    world_size: int
    rank: int
    device: torch.device
    gloo: bool = False

    @property
    def nccl(self) -> bool:
        """Whether the group's collectives run on CUDA (NCCL)."""
        return self.device.type == "cuda"

    @staticmethod
    def of(group: dist.ProcessGroup | None) -> GroupInfo:
        """The facts of ``group`` (the default group for ``None``); a lone process without a group.

        Raises:
            ValueError: this rank is not a member of ``group``.
        """
        global _last_info
        if not is_distributed():
            return GroupInfo(group, False, 1, 0, _CPU)
        pg = group if group is not None else dist.group.WORLD
        last_group, info = _last_info
        if last_group() is pg and info.group is group:
            return info
        if not isinstance(pg, dist.ProcessGroup):
            raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the process group it was given")
        info = GroupInfo(group, True, pg.size(), pg.rank(), device_of_group(pg, group), pg.name() == "gloo")
        if info.device.type == "cpu":  # a CUDA group's device follows torch.cuda.set_device: looked up each time
            _last_info = (weakref.ref(pg), info)
        return info

    @property
    def alone(self) -> bool:
        """No communication needed: no process group, or a group of one."""
        return not self.distributed or self.world_size == 1

    def global_rank(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what ``src`` arguments take)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


# The last CPU group GroupInfo.of looked up (a weak reference: a destroyed group is not kept alive), and its facts:
# a group's size and this rank's place in it never change, and most programs use one group.
_last_info: tuple[Callable[[], dist.ProcessGroup | None], GroupInfo] = (_nothing, GroupInfo(None, False, 1, 0, _CPU))
