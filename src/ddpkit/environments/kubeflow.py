"""Kubeflow's PyTorchJob: one process per pod, variables set by the training operator."""

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

__all__ = ["KubeflowEnvironment"]

_REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class KubeflowEnvironment(ClusterEnvironment):
    """A Kubeflow PyTorchJob pod running one process.

    Detected when ``KUBERNETES_PORT``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``WORLD_SIZE`` and ``RANK`` are all set (a pod that runs torchrun inside is a
    :class:`~ddpkit.TorchElasticEnvironment` instead). ``WORLD_SIZE`` counts
    pods, ``RANK`` is the pod's index, which is also its node rank; the local
    rank is 0.
    """

    name = "kubeflow"

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        source = env_or_os(env)
        return all(source.get(name, "").strip() for name in _REQUIRED)

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        require(env, _REQUIRED[1:], "the Kubeflow PyTorchJob environment")
        world_size = int_var(env, "WORLD_SIZE")
        rank = int_var(env, "RANK")
        check_below("RANK", rank, "WORLD_SIZE", world_size)
        return ClusterSettings(
            master_addr=env["MASTER_ADDR"].strip(),
            master_port=int_var(env, "MASTER_PORT"),
            world_size=world_size,
            global_rank=rank,
            local_rank=0,
            node_rank=rank,
            local_world_size=1,
        )
