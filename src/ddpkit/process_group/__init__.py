"""The default process group as the rest of ddpkit sees it: ranks, world sizes, barriers, rank zero, seeding.

Every helper here is safe without a process group: ranks read 0, world sizes 1,
and barriers return at once, so the same code runs in one process. Creating and
destroying the group is :mod:`ddpkit.connection` (its names are re-exported here).
Its modules: ``_ranks`` (ranks, world sizes, barriers, devices), ``_rank_zero``
(``rank_zero_only``, ``rank_zero_first`` and the failure it passes on),
``_seeding``.
"""

from __future__ import annotations

from ddpkit.connection import (
    SupportsClusterEnvironment,
    SupportsMainAddress,
    destroy_dist_connection,
    ensure_dist_connection,
    init_dist_connection,
    main_address_and_port,
)
from ddpkit.process_group._rank_zero import rank_zero_first, rank_zero_only
from ddpkit.process_group._ranks import (
    barrier,
    collective_device,
    device_of_group,
    get_local_rank,
    get_rank,
    get_world_size,
    is_ddp,
    is_distributed,
    rank_device,
)
from ddpkit.process_group._seeding import seed_everything

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
