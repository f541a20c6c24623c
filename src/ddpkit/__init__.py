"""ddpkit: correct PyTorch Distributed Data Parallel training, from one CPU to a cluster.

Built on ``torch.distributed`` (c10d: gloo and NCCL) and PyTorch's elastic
launcher. Importing ddpkit changes no state: no environment variables, no
logging handlers, no process group.
"""

from __future__ import annotations

from ddpkit.batches import move_data_to_device
from ddpkit.callbacks import (
    Callback,
    CallbacksHandler,
    CSVLogger,
    DistributedSamplerSetEpoch,
    EarlyStopping,
    ModelCheckpoint,
    TensorBoardLogger,
)
from ddpkit.checkpoint import load_checkpoint, save_checkpoint
from ddpkit.collectives import (
    AllGatherGrad,
    all_gather_ddp_if_available,
    all_gather_object,
    broadcast_object,
    gather_all_tensors,
    merge_list_of_dicts,
    mp_sync,
    mp_sync_dict,
    sync_ddp,
    sync_ddp_if_available,
    sync_dicts_ddp,
)
from ddpkit.comm_hooks import register_ddp_comm_hook
from ddpkit.ddp_handler import DDPHandler
from ddpkit.ddp_plugin import DDPPlugin
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
    GroupProofError,
    HangError,
    JobSecretError,
    PortTakenError,
    RendezvousFailedError,
    WarningDDP,
    WorkerFailedError,
)
from ddpkit.fsdp_plugin import FSDPPlugin

# Through the module ddpkit.launch, so that it is loaded now and ``ddpkit.launch`` stays the function
# (a first ``import ddpkit.launch`` later would set the attribute to the module).
from ddpkit.launch import launch, run_script
from ddpkit.loaders import (
    build_loader_sampler,
    check_loaders_is_patched,
    extract_loader_parameters,
    patch_dataloader_to_ddp,
    stream_loader,
)
from ddpkit.ordered import gather_in_order, gather_stream_in_order
from ddpkit.parallel_plugin import ParallelPlugin, unwrap_model
from ddpkit.process_group import (
    barrier,
    destroy_dist_connection,
    ensure_dist_connection,
    get_local_rank,
    get_rank,
    get_world_size,
    init_dist_connection,
    is_ddp,
    is_distributed,
    rank_zero_first,
    rank_zero_only,
    seed_everything,
)
from ddpkit.samplers import DDPSamplerWrapper, DistributedSamplerWrapper
from ddpkit.streams import ShardedStream, StreamDataLoader
from ddpkit.training import TrainLoop

__version__ = "0.2.0"

__all__ = [
    "AllGatherGrad",
    "CSVLogger",
    "Callback",
    "CallbacksHandler",
    "ClusterEnvironment",
    "ClusterEnvironmentError",
    "ClusterSettings",
    "CollectiveMismatchError",
    "DDPHandler",
    "DDPKitError",
    "DDPPlugin",
    "DDPSamplerWrapper",
    "DistributedSamplerSetEpoch",
    "DistributedSamplerWrapper",
    "EarlyStopping",
    "FSDPPlugin",
    "GroupProofError",
    "HangError",
    "JobSecretError",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "ModelCheckpoint",
    "ParallelPlugin",
    "PortTakenError",
    "RendezvousFailedError",
    "SLURMEnvironment",
    "ShardedStream",
    "StreamDataLoader",
    "TensorBoardLogger",
    "TorchElasticEnvironment",
    "TrainLoop",
    "WarningDDP",
    "WorkerFailedError",
    "__version__",
    "all_gather_ddp_if_available",
    "all_gather_object",
    "barrier",
    "broadcast_object",
    "build_loader_sampler",
    "check_loaders_is_patched",
    "destroy_dist_connection",
    "detect_environment",
    "ensure_dist_connection",
    "extract_loader_parameters",
    "gather_all_tensors",
    "gather_in_order",
    "gather_stream_in_order",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_dist_connection",
    "is_ddp",
    "is_distributed",
    "launch",
    "load_checkpoint",
    "merge_list_of_dicts",
    "move_data_to_device",
    "mp_sync",
    "mp_sync_dict",
    "patch_dataloader_to_ddp",
    "rank_zero_first",
    "rank_zero_only",
    "register_ddp_comm_hook",
    "run_script",
    "save_checkpoint",
    "seed_everything",
    "stream_loader",
    "sync_ddp",
    "sync_ddp_if_available",
    "sync_dicts_ddp",
    "unwrap_model",
]
