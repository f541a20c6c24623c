"""Collectives that never hang and never lie.

Every gather first exchanges a small metadata record and validates it on every
rank: incompatible inputs raise :class:`~ddpkit.CollectiveMismatchError` on
every rank, naming each rank's value, instead of hanging or returning garbage.
Tensor data is never pickled. Every function accepts ``group=None`` (the whole
world) and works without a process group (as with one rank).
"""

from __future__ import annotations

from ddpkit.collectives.gather import AllGatherGrad, all_gather_ddp_if_available, gather_all_tensors
from ddpkit.collectives.objects import all_gather_object, broadcast_object
from ddpkit.collectives.reduce import sync_ddp, sync_ddp_if_available
from ddpkit.collectives.sync import merge_list_of_dicts, mp_sync, mp_sync_dict, sync_dicts_ddp

__all__ = [
    "AllGatherGrad",
    "all_gather_ddp_if_available",
    "all_gather_object",
    "broadcast_object",
    "gather_all_tensors",
    "merge_list_of_dicts",
    "mp_sync",
    "mp_sync_dict",
    "sync_ddp",
    "sync_ddp_if_available",
    "sync_dicts_ddp",
]
