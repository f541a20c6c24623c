"""Processes started by torchrun / the elastic launcher (``ddpkit run`` and ``launch`` too)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.environments.base import (
    ClusterEnvironment,
    ClusterSettings,
    check_below,
    env_or_os,
    int_var,
    require,
)

__all__ = ["TorchElasticEnvironment"]

_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


class TorchElasticEnvironment(ClusterEnvironment):
    """The variables torchrun sets in every worker.

    Detected by ``TORCHELASTIC_RUN_ID``, ``GROUP_RANK`` or ``LOCAL_WORLD_SIZE``;
    then ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK`` (the node rank), ``MASTER_ADDR`` and ``MASTER_PORT`` must all
    be set and consistent.
    """

    name = "torchelastic"

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        source = env_or_os(env)
        return any(marker in source for marker in _MARKERS)

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        require(env, _REQUIRED, "the torchrun environment", "start the script with torchrun or `ddpkit run`")
        world_size = int_var(env, "WORLD_SIZE")
        rank = int_var(env, "RANK")
        local_rank = int_var(env, "LOCAL_RANK")
        local_world_size = int_var(env, "LOCAL_WORLD_SIZE")
        check_below("RANK", rank, "WORLD_SIZE", world_size)
        check_below("LOCAL_RANK", local_rank, "LOCAL_WORLD_SIZE", local_world_size)
        check_below("LOCAL_WORLD_SIZE", local_world_size - 1, "WORLD_SIZE", world_size)
        return ClusterSettings(
            master_addr=env["MASTER_ADDR"].strip(),
            master_port=int_var(env, "MASTER_PORT"),
            world_size=world_size,
            global_rank=rank,
            local_rank=local_rank,
            node_rank=int_var(env, "GROUP_RANK"),
            local_world_size=local_world_size,
        )
