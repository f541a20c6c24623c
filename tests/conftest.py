"""Shared fixtures: every test starts with the same environment and no process group."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import settings

from ddpkit.testing import close_pools

# The first example may import torch code paths; timing is not what these properties test.
settings.register_profile("ddpkit", deadline=None, print_blob=True)
settings.load_profile("ddpkit")


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session", autouse=True)
def _close_test_pools() -> Iterator[None]:
    yield
    close_pools()


# --- tests under a real scheduler: `slurm` needs a running Slurm cluster, `mpi` an mpirun; ------
# --- tests in a network namespace of their own: `netns` needs `unshare -n` and `ip` ---------------

#: Set (to 1) where the cluster and namespaces must be there, as in CI: the slurm, mpi and netns tests then fail
#: instead of skipping.
REQUIRE_SCHEDULERS = "DDPKIT_REQUIRE_SCHEDULERS"


def _slurm_missing() -> str | None:
    if shutil.which("srun") is None or shutil.which("sbatch") is None:
        return "no srun/sbatch on the PATH (bring a test cluster up with tools/slurm-up.sh)"
    try:
        subprocess.run(["sinfo", "-h"], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError):
        return "Slurm is installed but its controller does not answer (tools/slurm-up.sh brings it up)"
    return None


def _mpi_missing() -> str | None:
    return None if shutil.which("mpirun") is not None else "no mpirun on the PATH (apt-get install openmpi-bin)"


def _netns_missing() -> str | None:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "no unshare or ip on the PATH (util-linux, iproute2)"
    try:
        subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=10)
    except (subprocess.SubprocessError, OSError):
        return "`unshare -n` cannot make a network namespace here (it needs root or user namespaces)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker, missing in (("slurm", _slurm_missing), ("mpi", _mpi_missing), ("netns", _netns_missing)):
        if item.get_closest_marker(marker) is not None and (reason := missing()) is not None:
            if os.environ.get(REQUIRE_SCHEDULERS, "0") not in ("", "0"):
                pytest.fail(f"{REQUIRE_SCHEDULERS} is set and the {marker} test cannot run: {reason}")
            pytest.skip(reason)
