"""ddpkit: correct PyTorch Distributed Data Parallel training, from one CPU to a cluster.

Built on ``torch.distributed`` (c10d: gloo and NCCL) and PyTorch's elastic
launcher. Importing ddpkit changes no state: no environment variables, no
logging handlers, no process group.
"""

from __future__ import annotations

from ddpkit.environments import (
    ClusterEnvironment,
    ClusterSettings,
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)
from ddpkit.errors import (
    ClusterEnvironmentError,
    CollectiveMismatchError,
    DDPKitError,
    WarningDDP,
    WorkerFailedError,
)
from ddpkit.launch import launch, run_script
from ddpkit.process_group import (
    barrier,
    destroy_dist_connection,
    get_local_rank,
    get_rank,
    get_world_size,
    init_dist_connection,
    is_distributed,
    rank_zero_first,
    rank_zero_only,
    seed_everything,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterEnvironment",
    "ClusterEnvironmentError",
    "ClusterSettings",
    "CollectiveMismatchError",
    "DDPKitError",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "WarningDDP",
    "WorkerFailedError",
    "__version__",
    "barrier",
    "destroy_dist_connection",
    "detect_environment",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_dist_connection",
    "is_distributed",
    "launch",
    "rank_zero_first",
    "rank_zero_only",
    "run_script",
    "seed_everything",
]
