"""Pick the cluster environment this process runs in."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.environments.base import ClusterEnvironment, env_or_os
from ddpkit.environments.kubeflow import KubeflowEnvironment
from ddpkit.environments.local import LocalEnvironment
from ddpkit.environments.lsf import LSFEnvironment
from ddpkit.environments.mpi import MPIEnvironment
from ddpkit.environments.slurm import SLURMEnvironment
from ddpkit.environments.torchelastic import TorchElasticEnvironment
from ddpkit.errors import ClusterEnvironmentError

__all__ = [
    "CLUSTER_ENV_VARIABLE",
    "ENVIRONMENTS",
    "detect_environment",
    "is_one_of_several_ranks",
    "launched_environment",
]

#: Set to one of ``ENVIRONMENTS``' names to skip detection (``local`` turns SLURM detection off).
CLUSTER_ENV_VARIABLE = "DDPKIT_CLUSTER_ENV"

#: Environments by name, in detection order: the most specific launcher first
#: (torchrun inside a SLURM job is torchrun; mpirun inside an sbatch script is MPI).
ENVIRONMENTS: dict[str, type[ClusterEnvironment]] = {
    cls.name: cls
    for cls in (
        TorchElasticEnvironment,
        KubeflowEnvironment,
        LSFEnvironment,
        MPIEnvironment,
        SLURMEnvironment,
        LocalEnvironment,
    )
}


def detect_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The cluster environment that ``env`` (default ``os.environ``) describes.

    ``DDPKIT_CLUSTER_ENV=local|torchelastic|kubeflow|lsf|mpi|slurm`` forces one
    (``auto`` or unset: detect). Otherwise the first environment in
    ``ENVIRONMENTS`` whose ``detect()`` is true wins; :class:`LocalEnvironment`
    is the fallback.

    Raises:
        ClusterEnvironmentError: ``DDPKIT_CLUSTER_ENV`` names no environment, or the
            chosen environment's variables are half-set or contradictory.
    """
    source = env_or_os(env)
    forced = source.get(CLUSTER_ENV_VARIABLE, "").strip().lower()
    if forced and forced != "auto":
        if forced not in ENVIRONMENTS:
            raise ClusterEnvironmentError(
                f"{CLUSTER_ENV_VARIABLE}={source[CLUSTER_ENV_VARIABLE]!r} is not an environment; "
                f"use one of: auto, {', '.join(ENVIRONMENTS)}"
            )
        return ENVIRONMENTS[forced](source)
    for cls in ENVIRONMENTS.values():
        if cls.detect(source):
            return cls(source)
    return LocalEnvironment(source)  # unreachable: LocalEnvironment.detect() is always true


def is_one_of_several_ranks(environment: ClusterEnvironment) -> bool:
    """Whether ``environment`` says a launcher started this process as one of several ranks of one job.

    That is: something other than this process created the job's processes
    (torchrun, ``ddpkit run``, ``srun``, ``mpirun``, a Kubeflow or LSF job, or
    ``RANK`` set by hand) and the world size is above 1. ``python train.py``,
    one SLURM task or ``WORLD_SIZE=1`` is a process alone.
    """
    return environment.creates_processes_externally and environment.world_size() > 1


def launched_environment(env: Mapping[str, str] | None = None) -> ClusterEnvironment | None:
    """The detected environment when a launcher started this process as one of several ranks; else ``None``.

    The one rule every entry point of ddpkit applies before it decides that it
    runs alone (see :func:`is_one_of_several_ranks`).

    Raises:
        ClusterEnvironmentError: as :func:`detect_environment` (half-set or contradictory variables).
    """
    environment = detect_environment(env)
    return environment if is_one_of_several_ranks(environment) else None
