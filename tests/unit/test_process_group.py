"""Process-group helpers: backend choice, idempotent init, rank helpers, rank_zero_first, seeding.

Here, the tests that need no process; the others are in tests/ranks/test_process_group.py.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpkit import (
    ClusterEnvironmentError,
    DDPKitError,
    DDPPlugin,
    LocalEnvironment,
    SLURMEnvironment,
    barrier,
    destroy_dist_connection,
    get_local_rank,
    get_rank,
    get_world_size,
    init_dist_connection,
    is_distributed,
    rank_zero_first,
    seed_everything,
)
from ddpkit._backends import resolve_backend as _resolve_backend
from ddpkit.hangs._watchdog import hang_timeout
from ddpkit.process_group import collective_device

# --- without a process group ------------------------------------------------------------


def test_helpers_are_safe_without_a_process_group() -> None:
    assert not is_distributed()
    assert (get_rank(), get_world_size(), get_local_rank()) == (0, 1, 0)
    barrier()
    assert collective_device() == torch.device("cpu")
    ran = []
    with rank_zero_first():
        ran.append(True)
    assert ran == [True]


def test_local_rank_comes_from_the_environment_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    assert get_local_rank() == 1
    assert get_rank() == 0, "get_rank() is the process group's rank: 0 without a group"


# --- backend choice ----------------------------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this machine has 2 CUDA devices and NCCL."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


def test_auto_backend_is_gloo_on_cpu() -> None:
    assert _resolve_backend(None, 0) == "gloo"
    assert _resolve_backend("auto", 3) == "gloo"


@pytest.mark.usefixtures("fake_cuda")
def test_auto_backend_is_nccl_for_a_rank_that_owns_a_cuda_device() -> None:
    assert _resolve_backend(None, 0) == "nccl"
    assert _resolve_backend(None, 1) == "nccl"
    assert _resolve_backend(None, 2) == "gloo", "local rank 2 has no device of its own among 2"
    assert _resolve_backend("NCCL", 1) == "nccl"
    assert _resolve_backend("cpu:gloo,cuda:nccl", 0) == "cpu:gloo,cuda:nccl"


def test_explicit_backends_are_validated_with_the_valid_names() -> None:
    assert _resolve_backend("Gloo", 0) == "gloo"
    with pytest.raises(ValueError, match=r"unknown torch_distributed_backend='tcp'; use one of gloo, nccl"):
        _resolve_backend("tcp", 0)
    with pytest.raises(ValueError, match=r"'mpi' is not available in this PyTorch build; available: gloo"):
        _resolve_backend("mpi", 0)


def test_nccl_without_a_cuda_device_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    with pytest.raises(ValueError, match=r"'nccl' needs a CUDA device for local rank 0, but this process sees 0"):
        _resolve_backend("nccl", 0)


# --- init_dist_connection -----------------------------------------------------------------


@pytest.fixture
def captured_init(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    return calls


def test_init_sets_master_variables_and_forwards_kwargs(captured_init: list[Any]) -> None:
    env = LocalEnvironment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4321", "WORLD_SIZE": "2", "RANK": "1"})
    init_dist_connection(env, None, timeout=12.5, group_name="g")
    ((args, kwargs),) = captured_init
    assert args == ("gloo",)
    assert kwargs == {"rank": 1, "world_size": 2, "timeout": timedelta(seconds=12.5), "group_name": "g"}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", "4321")
    assert os.environ["GLOO_SOCKET_IFNAME"].startswith("lo"), "a loopback master pins gloo to loopback"


def test_init_accepts_any_object_with_the_seed_methods(captured_init: list[Any]) -> None:
    class SeedStyleEnvironment:  # Lightning 1.x's DDPPlugin calls only these three
        def master_address(self) -> str:
            return "10.0.0.1"

        def master_port(self) -> int:
            return 5555

        def world_size(self) -> int:
            return 4

    init_dist_connection(SeedStyleEnvironment(), "gloo", global_rank=2)
    assert captured_init[0][1]["rank"] == 2
    assert "GLOO_SOCKET_IFNAME" not in os.environ, "a remote master must not pin gloo to loopback"
    with pytest.raises(TypeError, match="pass global_rank="):
        init_dist_connection(SeedStyleEnvironment(), "gloo")


def test_init_accepts_lightning_2_environments(captured_init: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning 1.6+ and 2.x environments have ``main_address``/``main_port`` properties, not the 1.x methods."""
    environments = pytest.importorskip("lightning.fabric.plugins.environments")
    for name, value in {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "6006", "WORLD_SIZE": "4", "NODE_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    env = environments.LightningEnvironment()
    env.set_world_size(4)
    env.set_global_rank(3)
    init_dist_connection(env, "gloo")
    assert captured_init[0][1]["rank"] == 3
    assert captured_init[0][1]["world_size"] == 4
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.2", "6006")
    DDPPlugin().init_ddp_connection(None, env, 3, 4)  # Lightning 1.x's plugin, given a 2.x environment
    assert captured_init[1][1]["rank"] == 3
    with pytest.raises(TypeError, match=r"object is not a cluster environment: it needs master_address\(\)"):
        init_dist_connection(object(), "gloo", global_rank=0, world_size=1)  # type: ignore[arg-type]


def test_an_unresolvable_master_address_fails_naming_it_and_its_source(captured_init: list[Any]) -> None:
    slurm = SLURMEnvironment(
        {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "77",
         "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[7-8].invalid"}
    )  # fmt: skip
    with pytest.raises(ClusterEnvironmentError, match=r"the master address 'gpu7.invalid' \(the first host of "
                       r"SLURM_JOB_NODELIST='gpu\[7-8\].invalid'\) does not resolve"):  # fmt: skip
        init_dist_connection(slurm, "gloo")
    local = LocalEnvironment({"MASTER_ADDR": "nowhere.invalid", "MASTER_PORT": "5", "WORLD_SIZE": "2", "RANK": "1"})
    with pytest.raises(ClusterEnvironmentError, match=r"'nowhere.invalid' \(MASTER_ADDR\) does not resolve"):
        init_dist_connection(local, "gloo")
    assert captured_init == [], "it fails before any process waits"


def test_the_hang_deadline_comes_from_the_argument_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPKIT_HANG_TIMEOUT", raising=False)
    assert [hang_timeout(), hang_timeout(12.5), hang_timeout(0), hang_timeout(float("inf"))] == [300, 12.5, None, None]
    monkeypatch.setenv("DDPKIT_HANG_TIMEOUT", "7")
    assert hang_timeout() == 7.0
    monkeypatch.setenv("DDPKIT_HANG_TIMEOUT", "off")
    assert hang_timeout() is None
    monkeypatch.setenv("DDPKIT_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"DDPKIT_HANG_TIMEOUT='soon' is not a number of seconds"):
        hang_timeout()
    with pytest.raises(ValueError, match=r"must be a number of seconds >= 0 \(0 turns it off\), got -1"):
        hang_timeout(-1)


def test_the_process_group_timeout_outlasts_the_hang_deadline(captured_init: list[Any]) -> None:
    env = LocalEnvironment({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4321", "WORLD_SIZE": "2", "RANK": "1"})
    init_dist_connection(env, "gloo", hang_timeout=900)
    assert captured_init[0][1]["timeout"] == timedelta(seconds=960), "else torch's 10-minute NCCL timeout came first"
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "256", "the flight recorder is on for the watchdog"


def test_init_explicit_rank_and_world_size_win_and_are_checked(captured_init: list[Any]) -> None:
    env = LocalEnvironment({"MASTER_PORT": "1"})
    init_dist_connection(env, "gloo", global_rank=1, world_size=3)
    assert captured_init[0][1] == {"rank": 1, "world_size": 3}
    with pytest.raises(ValueError, match=r"global_rank=3 must be in \[0, world_size=3\)"):
        init_dist_connection(env, "gloo", global_rank=3, world_size=3)


def test_init_refuses_several_processes_without_an_agreed_port(captured_init: list[Any]) -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"world_size=2, rank=0, but MASTER_PORT is not set"):
        init_dist_connection(LocalEnvironment({}), "gloo", global_rank=0, world_size=2)
    assert captured_init == []


def test_init_raises_runtime_error_without_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"torch\.distributed is not available"):
        init_dist_connection()


def test_init_is_idempotent_and_detects_contradictions() -> None:
    init_dist_connection(LocalEnvironment({}), "gloo", timeout=timedelta(seconds=10))
    assert is_distributed()
    assert (get_rank(), get_world_size()) == (0, 1)
    group = dist.group.WORLD
    init_dist_connection()  # a second call: nothing happens
    init_dist_connection(global_rank=0, world_size=1)
    assert dist.group.WORLD is group
    with pytest.raises(DDPKitError, match=r"already exists as rank 0 of 1, .*world_size=2"):
        init_dist_connection(world_size=2)
    destroy_dist_connection()
    assert not is_distributed()
    destroy_dist_connection()  # and again: still fine


# --- with a process group (pool) -----------------------------------------------------------


def test_seed_everything_rejects_out_of_range_seeds() -> None:
    with pytest.raises(ValueError, match=r"seed=-1 must be in \[0, 2\*\*32\)"):
        seed_everything(-1)
    with pytest.raises(ValueError, match=r"seed=4294967296"):
        seed_everything(2**32)
