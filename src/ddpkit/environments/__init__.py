"""Cluster environments: where each process sits in the job, read from environment variables.

Each environment parses a ``Mapping[str, str]`` (``os.environ`` by default) into a
frozen :class:`ClusterSettings`; nothing here writes ``os.environ``.
"""

from __future__ import annotations

from ddpkit.environments.base import ClusterEnvironment, ClusterSettings, find_free_port, is_loopback
from ddpkit.environments.detect import (
    CLUSTER_ENV_VARIABLE,
    ENVIRONMENTS,
    detect_environment,
    is_one_of_several_ranks,
    launched_environment,
)
from ddpkit.environments.kubeflow import KubeflowEnvironment
from ddpkit.environments.local import LocalEnvironment
from ddpkit.environments.lsf import LSFEnvironment
from ddpkit.environments.mpi import MPIEnvironment
from ddpkit.environments.slurm import SLURMEnvironment, expand_hostlist
from ddpkit.environments.torchelastic import TorchElasticEnvironment

__all__ = [
    "CLUSTER_ENV_VARIABLE",
    "ENVIRONMENTS",
    "ClusterEnvironment",
    "ClusterSettings",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "detect_environment",
    "expand_hostlist",
    "find_free_port",
    "is_loopback",
    "is_one_of_several_ranks",
    "launched_environment",
]
