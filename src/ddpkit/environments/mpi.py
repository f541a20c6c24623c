"""Processes started by ``mpirun``/``mpiexec`` (Open MPI, or MPICH / Intel MPI / Cray PMI)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.environments.base import (
    ClusterEnvironment,
    ClusterSettings,
    check_below,
    env_or_os,
    int_var,
    port_from_job_id,
    require,
)
from ddpkit.errors import ClusterEnvironmentError

__all__ = ["MPIEnvironment"]

# (rank, size, local rank, local size) variable names of each launcher family.
_OPEN_MPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
_HYDRA = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_PALS = ("PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE")
# Variables that hold the same job identifier in every process of the job.
_JOB_IDS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PALS_APID", "PBS_JOBID", "SLURM_JOB_ID", "LSB_JOBID")


def _family(env: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    if "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        return _OPEN_MPI
    if "PMI_RANK" in env and "MPI_LOCALRANKID" in env:
        return _HYDRA
    if "PMI_RANK" in env and "PMI_LOCAL_RANK" in env:
        return _PALS
    return None


class MPIEnvironment(ClusterEnvironment):
    """One process per MPI rank, as ``mpirun`` started them (no mpi4py needed).

    Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``,
    ``_LOCAL_SIZE``. MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``,
    ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``. Cray PALS: ``PMI_RANK``,
    ``PMI_SIZE``, ``PMI_LOCAL_RANK``, ``PMI_LOCAL_SIZE``. The node rank is
    ``rank // local size`` (ranks placed on nodes in blocks, mpirun's default).

    The master address is ``MASTER_ADDR``, or ``127.0.0.1`` when every rank is on
    this node; a multi-node job must set ``MASTER_ADDR`` (e.g. ``mpirun -x
    MASTER_ADDR=$(hostname) ...``). The master port is ``MASTER_PORT``, else
    derived from the job id (``PMIX_NAMESPACE``, ``OMPI_MCA_ess_base_jobid``,
    ``PALS_APID``, ``PBS_JOBID``, ``SLURM_JOB_ID`` or ``LSB_JOBID``).
    """

    name = "mpi"

    @staticmethod
    def detect(env: Mapping[str, str] | None = None) -> bool:
        return _family(env_or_os(env)) is not None

    @classmethod
    def parse(cls, env: Mapping[str, str]) -> ClusterSettings:
        family = _family(env)
        if family is None:
            raise ClusterEnvironmentError(
                "no MPI launcher variables found (OMPI_COMM_WORLD_RANK, or PMI_RANK with "
                "MPI_LOCALRANKID or PMI_LOCAL_RANK); start the processes with mpirun"
            )
        rank_var, size_var, local_rank_var, local_size_var = family
        require(env, family, "the MPI environment", "start the processes with mpirun")
        world_size = int_var(env, size_var)
        rank = int_var(env, rank_var)
        local_rank = int_var(env, local_rank_var)
        local_size = int_var(env, local_size_var)
        check_below(rank_var, rank, size_var, world_size)
        check_below(local_rank_var, local_rank, local_size_var, local_size)
        check_below(local_size_var, local_size - 1, size_var, world_size)

        master_addr = env.get("MASTER_ADDR", "").strip()
        if not master_addr:
            if local_size != world_size:
                raise ClusterEnvironmentError(
                    f"this MPI job spans several nodes ({local_size_var}={local_size}, {size_var}={world_size}) "
                    "but MASTER_ADDR is not set; export MASTER_ADDR=<host of rank 0> to every rank "
                    "(e.g. mpirun -x MASTER_ADDR=$(hostname) ...)"
                )
            master_addr = "127.0.0.1"
        return ClusterSettings(
            master_addr=master_addr,
            master_port=_master_port(env),
            world_size=world_size,
            global_rank=rank,
            local_rank=local_rank,
            node_rank=rank // local_size,
            local_world_size=local_size,
        )


def _master_port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT", "").strip():
        return int_var(env, "MASTER_PORT")
    for name in _JOB_IDS:
        if env.get(name, "").strip():
            return port_from_job_id(env[name], name)
    raise ClusterEnvironmentError(
        f"cannot derive a port every MPI rank agrees on: none of MASTER_PORT, {', '.join(_JOB_IDS)} is set; "
        "export MASTER_PORT=<free port> to every rank (e.g. mpirun -x MASTER_PORT=29500 ...)"
    )
