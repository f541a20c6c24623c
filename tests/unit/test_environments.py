"""Cluster environments parse plain dicts; bad variables raise naming the variables and values."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpkit import (
    ClusterEnvironment,
    ClusterEnvironmentError,
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    detect_environment,
)
from ddpkit.environments import expand_hostlist, is_one_of_several_ranks, launched_environment


def settings_of(env: ClusterEnvironment) -> tuple[str, int, int, int, int, int]:
    return (
        env.master_address(),
        env.master_port(),
        env.world_size(),
        env.global_rank(),
        env.local_rank(),
        env.node_rank(),
    )


# --- local ------------------------------------------------------------------------------


def test_local_defaults_to_one_process_on_loopback_with_a_free_port() -> None:
    env = LocalEnvironment({})
    port = env.master_port()
    assert settings_of(env) == ("127.0.0.1", port, 1, 0, 0, 0)
    assert env.master_port() == port, "the chosen port must not change between calls"
    assert env.port_was_chosen
    assert not env.creates_processes_externally
    with socket.socket() as sock:  # it was free: we can bind it
        sock.bind(("127.0.0.1", port))


def test_local_reads_env_style_variables() -> None:
    env = LocalEnvironment(
        {
            "MASTER_ADDR": "10.0.0.5",
            "MASTER_PORT": "1234",
            "WORLD_SIZE": "4",
            "RANK": "3",
            "LOCAL_RANK": "1",
            "NODE_RANK": "1",
        }
    )
    assert settings_of(env) == ("10.0.0.5", 1234, 4, 3, 1, 1)
    assert env.creates_processes_externally
    assert not env.port_was_chosen


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, r"RANK='1' is set but WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, r"WORLD_SIZE='2' is set but RANK is not"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, r"RANK=2 must be smaller than WORLD_SIZE=2"),
        ({"WORLD_SIZE": "two", "RANK": "0"}, r"WORLD_SIZE='two' is not an integer"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, r"RANK='-1' is negative"),
        ({"MASTER_PORT": "70000"}, r"master port 70000 is outside"),
    ],
)
def test_local_rejects_half_set_or_contradictory_variables(env: dict[str, str], message: str) -> None:
    with pytest.raises(ClusterEnvironmentError, match=message):
        LocalEnvironment(env)


# --- torchelastic -----------------------------------------------------------------------

TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "29500",
}


def test_torchelastic_reads_torchrun_variables() -> None:
    assert TorchElasticEnvironment.detect(TORCHRUN)
    env = TorchElasticEnvironment(TORCHRUN)
    assert settings_of(env) == ("node7", 29500, 8, 5, 1, 1)
    assert env.creates_processes_externally


@pytest.mark.parametrize("marker", ["TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE"])
def test_torchelastic_is_detected_by_any_torchrun_only_variable(marker: str) -> None:
    assert TorchElasticEnvironment.detect({marker: "1"})
    assert not TorchElasticEnvironment.detect({"RANK": "0", "WORLD_SIZE": "1"})


def test_torchelastic_half_set_names_missing_and_present_variables() -> None:
    env = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "0"}
    with pytest.raises(ClusterEnvironmentError, match=r"half-set: WORLD_SIZE, LOCAL_RANK, .*RANK='0'"):
        TorchElasticEnvironment(env)


def test_torchelastic_local_rank_must_fit_local_world_size() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"LOCAL_RANK=4 must be smaller than LOCAL_WORLD_SIZE=4"):
        TorchElasticEnvironment({**TORCHRUN, "LOCAL_RANK": "4"})


# --- SLURM ------------------------------------------------------------------------------

SLURM = {
    "SLURM_JOB_ID": "1234567",
    "SLURM_JOB_NAME": "train",
    "SLURM_NTASKS": "8",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu[003-004]",
}


def test_slurm_reads_srun_variables_and_derives_the_port_from_the_job_id() -> None:
    env = SLURMEnvironment(SLURM)
    assert settings_of(env) == ("gpu003", 15000 + 4567, 8, 6, 2, 1)


def test_slurm_master_variables_override_the_derived_ones() -> None:
    env = SLURMEnvironment({**SLURM, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "4000"})
    assert (env.master_address(), env.master_port()) == ("10.1.1.1", 4000)


def test_slurm_uses_the_older_nodelist_variable_when_the_newer_is_absent() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    assert SLURMEnvironment({**env, "SLURM_NODELIST": "a,b"}).master_address() == "a"


def test_slurm_finds_the_node_without_slurm_nodeid() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_NODEID"}
    assert SLURMEnvironment({**env, "SLURMD_NODENAME": "gpu004"}).node_rank() == 1
    assert SLURMEnvironment({**env, "SLURM_JOB_NODELIST": "gpu003"}).node_rank() == 0


@pytest.mark.parametrize(
    ("variables", "tasks_here"),
    [
        ({"SLURM_TASKS_PER_NODE": "4(x2)"}, 4),
        ({"SLURM_TASKS_PER_NODE": "5,3"}, 3),  # this task is on node 1
        ({"SLURM_STEP_TASKS_PER_NODE": "2,6", "SLURM_TASKS_PER_NODE": "4(x2)"}, 6),  # the step's own layout wins
        ({"SLURM_NTASKS_PER_NODE": "4"}, 4),  # set only with --ntasks-per-node
        ({"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "3"}, 4),
        ({"SLURM_JOB_NODELIST": "gpu003", "SLURM_NODEID": "0"}, 8),  # one host: every task is on it
        ({}, None),  # two hosts and no per-node count: unknown
        ({"SLURM_TASKS_PER_NODE": "2(x2)"}, None),  # SLURM_LOCALID=2 contradicts it: unknown, not wrong
        ({"SLURM_TASKS_PER_NODE": "four"}, None),
    ],
)
def test_slurm_knows_how_many_tasks_share_this_node(variables: dict[str, str], tasks_here: int | None) -> None:
    assert SLURMEnvironment({**SLURM, **variables}).local_world_size() == tasks_here


def test_local_world_size_of_the_other_environments() -> None:
    assert TorchElasticEnvironment(TORCHRUN).local_world_size() == 4
    assert MPIEnvironment(OPEN_MPI).local_world_size() == 4
    assert LocalEnvironment({}).local_world_size() == 1
    assert LocalEnvironment({"RANK": "1", "WORLD_SIZE": "2"}).local_world_size() is None
    assert LocalEnvironment({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}).local_world_size() == 2
    with pytest.raises(ClusterEnvironmentError, match=r"LOCAL_WORLD_SIZE=6 must not exceed WORLD_SIZE=4"):
        LocalEnvironment({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "6"})


def test_slurm_is_not_detected_in_an_interactive_allocation() -> None:
    assert SLURMEnvironment.detect(SLURM)
    assert not SLURMEnvironment.detect({**SLURM, "SLURM_JOB_NAME": "bash"})
    assert not SLURMEnvironment.detect({**SLURM, "SLURM_JOB_NAME": "interactive"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"SLURM_PROCID": None}, r"half-set: SLURM_PROCID not set \(while SLURM_NTASKS='8'"),
        ({"SLURM_PROCID": "8"}, r"SLURM_PROCID=8 must be smaller than SLURM_NTASKS=8"),
        (
            {"SLURM_NODEID": "2"},
            r"SLURM_NODEID=2 must be smaller than the number of hosts in "
            r"SLURM_JOB_NODELIST='gpu\[003-004\]'=2",
        ),
        ({"SLURM_JOB_ID": None}, r"neither SLURM_JOB_ID nor MASTER_PORT is set"),
        ({"SLURM_JOB_NODELIST": None}, r"neither SLURM_JOB_NODELIST nor SLURM_NODELIST nor MASTER_ADDR"),
        ({"SLURM_JOB_NODELIST": "gpu[004-003]"}, r"descending range '004-003'"),
        ({"SLURM_NODEID": None}, r"SLURM_NODEID is not set and SLURMD_NODENAME='' does not name a host"),
    ],
)
def test_slurm_rejects_half_set_or_contradictory_variables(changes: dict[str, str | None], message: str) -> None:
    env = {**SLURM, **{k: v for k, v in changes.items() if v is not None}}
    for key in [k for k, v in changes.items() if v is None]:
        del env[key]
    with pytest.raises(ClusterEnvironmentError, match=message):
        SLURMEnvironment(env)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("gpu[1-2]-ib,cpu5", ["gpu1-ib", "gpu2-ib", "cpu5"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[1],b[09-10]", ["a1", "b09", "b10"]),
    ],
)
def test_expand_hostlist(nodelist: str, hosts: list[str]) -> None:
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "node[1-2", "node1-2]", "node[a-b]", "node[]", "a,,b", "node[[1]]"])
def test_expand_hostlist_rejects_malformed_lists(nodelist: str) -> None:
    with pytest.raises(ClusterEnvironmentError, match="host list"):
        expand_hostlist(nodelist)


@given(
    prefix=st.from_regex(r"[a-z][a-z0-9\-]{0,6}[a-z]", fullmatch=True),
    width=st.integers(1, 4),
    numbers=st.sets(st.integers(0, 999), min_size=1, max_size=30),
)
def test_expand_hostlist_inverts_slurm_compression(prefix: str, width: int, numbers: set[int]) -> None:
    """Compress sorted numbers into SLURM's range form, as scontrol would; expansion gives them back."""
    values = sorted(numbers)
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    body = ",".join(
        f"{run[0]:0{width}d}" if len(run) == 1 else f"{run[0]:0{width}d}-{run[-1]:0{width}d}" for run in runs
    )
    assert expand_hostlist(f"{prefix}[{body}]") == [f"{prefix}{v:0{width}d}" for v in values]


# --- MPI --------------------------------------------------------------------------------

OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_NAMESPACE": "prterun-host-4242@1",
    "MASTER_ADDR": "host0",
}


def test_mpi_reads_open_mpi_variables() -> None:
    env = MPIEnvironment(OPEN_MPI)
    address, port, *placement = settings_of(env)
    assert (address, placement) == ("host0", [8, 5, 1, 1])
    assert 15000 <= port < 25000
    assert MPIEnvironment({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "0"}).master_port() == port, "ranks must agree"


def test_mpi_reads_hydra_and_pals_variables() -> None:
    hydra = {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3", "MASTER_PORT": "999"}
    assert settings_of(MPIEnvironment(hydra)) == ("127.0.0.1", 999, 3, 2, 2, 0)
    pals = {
        "PMI_RANK": "3",
        "PMI_SIZE": "4",
        "PMI_LOCAL_RANK": "1",
        "PMI_LOCAL_SIZE": "2",
        "PALS_APID": "77",
        "MASTER_ADDR": "n0",
    }
    assert settings_of(MPIEnvironment(pals)) == ("n0", 15077, 4, 3, 1, 1)


def test_mpi_single_node_defaults_to_loopback_but_multi_node_needs_master_addr() -> None:
    single = {**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
    del single["MASTER_ADDR"]
    assert MPIEnvironment(single).master_address() == "127.0.0.1"
    multi = dict(OPEN_MPI)
    del multi["MASTER_ADDR"]
    with pytest.raises(ClusterEnvironmentError, match=r"spans several nodes .*set MASTER_ADDR|MASTER_ADDR is not set"):
        MPIEnvironment(multi)


def test_mpi_without_a_job_id_or_master_port_says_what_to_set() -> None:
    env = {k: v for k, v in OPEN_MPI.items() if k != "PMIX_NAMESPACE"}
    with pytest.raises(ClusterEnvironmentError, match=r"export MASTER_PORT"):
        MPIEnvironment(env)


def test_mpi_half_set_names_the_missing_variable() -> None:
    env = {k: v for k, v in OPEN_MPI.items() if k != "OMPI_COMM_WORLD_SIZE"}
    with pytest.raises(ClusterEnvironmentError, match=r"OMPI_COMM_WORLD_SIZE not set .*OMPI_COMM_WORLD_RANK='5'"):
        MPIEnvironment(env)


def test_mpi_is_not_detected_from_pmi_rank_alone() -> None:
    """srun --mpi=pmi2 sets PMI_RANK but no local rank: that job is SLURM's, not mpirun's."""
    assert not MPIEnvironment.detect({"PMI_RANK": "0", "PMI_SIZE": "2"})


# --- Kubeflow and LSF ------------------------------------------------------------------

KUBEFLOW = {
    "KUBERNETES_PORT": "tcp://10.0.0.1:443",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
}


def test_kubeflow_reads_pod_variables() -> None:
    assert KubeflowEnvironment.detect(KUBEFLOW)
    assert settings_of(KubeflowEnvironment(KUBEFLOW)) == ("job-master-0", 23456, 3, 2, 0, 2)
    assert not KubeflowEnvironment.detect({k: v for k, v in KUBEFLOW.items() if k != "RANK"})


def test_kubeflow_forced_but_half_set_names_the_missing_variables() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"WORLD_SIZE, RANK not set"):
        detect_environment({"DDPKIT_CLUSTER_ENV": "kubeflow", "MASTER_ADDR": "m", "MASTER_PORT": "1"})


@pytest.fixture
def rankfile(tmp_path: Path) -> Path:
    path = tmp_path / "rankfile"
    path.write_text("batch1\nhostA\nhostA\nhostB\nhostB\n")
    return path


def test_lsf_reads_jsrun_variables_and_the_rankfile(rankfile: Path) -> None:
    env = {
        "LSB_JOBID": "123456",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "JSM_NAMESPACE_RANK": "3",
        "JSM_NAMESPACE_SIZE": "4",
        "JSM_NAMESPACE_LOCAL_RANK": "1",
        "HOSTNAME": "hostB",
    }
    assert LSFEnvironment.detect(env)
    assert settings_of(LSFEnvironment(env)) == ("hostA", 10456, 4, 3, 1, 1)


def test_lsf_errors_name_the_rankfile(rankfile: Path, tmp_path: Path) -> None:
    env = {
        "LSB_JOBID": "1",
        "LSB_DJOB_RANKFILE": str(tmp_path / "missing"),
        "JSM_NAMESPACE_RANK": "0",
        "JSM_NAMESPACE_SIZE": "1",
        "JSM_NAMESPACE_LOCAL_RANK": "0",
        "HOSTNAME": "hostA",
    }
    with pytest.raises(ClusterEnvironmentError, match=r"cannot read LSB_DJOB_RANKFILE='.*missing'"):
        LSFEnvironment(env)
    with pytest.raises(ClusterEnvironmentError, match=r"this host 'elsewhere' is not in LSB_DJOB_RANKFILE"):
        LSFEnvironment({**env, "LSB_DJOB_RANKFILE": str(rankfile), "HOSTNAME": "elsewhere"})


# --- detection --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LocalEnvironment),
        ({"RANK": "0", "WORLD_SIZE": "1"}, LocalEnvironment),
        (SLURM, SLURMEnvironment),
        (OPEN_MPI, MPIEnvironment),
        (KUBEFLOW, KubeflowEnvironment),
        (TORCHRUN, TorchElasticEnvironment),
        ({**SLURM, **TORCHRUN}, TorchElasticEnvironment),  # torchrun inside a SLURM job
        ({**SLURM, "SLURM_PROCID": "0", **OPEN_MPI}, MPIEnvironment),  # mpirun inside an sbatch script
        ({**KUBEFLOW, **TORCHRUN}, TorchElasticEnvironment),  # torchrun inside a Kubeflow pod
    ],
)
def test_detect_environment_picks_the_most_specific_launcher(env: dict[str, str], expected: type) -> None:
    assert type(detect_environment(env)) is expected


@pytest.mark.parametrize(
    ("env", "launched"),
    [
        ({}, False),  # python train.py
        ({"RANK": "0", "WORLD_SIZE": "1"}, False),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, True),  # set by hand, or by a tutorial's script
        (
            {**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_RANK": "0"},
            False,
        ),
        (TORCHRUN, True),
        (SLURM, True),
        ({**SLURM, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}, False),
        ({**SLURM, "SLURM_JOB_NAME": "interactive"}, False),  # an allocation's shell: start the processes yourself
        (OPEN_MPI, True),
        (KUBEFLOW, True),
    ],
)
def test_one_rule_says_whether_a_launcher_started_this_process_as_one_of_several_ranks(
    env: dict[str, str], launched: bool
) -> None:
    assert is_one_of_several_ranks(detect_environment(env)) is launched
    found = launched_environment(env)
    assert (found is not None) is launched
    if found is not None:
        assert found.world_size() > 1


def test_the_rule_raises_for_half_set_variables_naming_them() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"WORLD_SIZE='2' is set but RANK is not"):
        launched_environment({"WORLD_SIZE": "2"})


def test_override_forces_an_environment_and_local_turns_slurm_off() -> None:
    assert type(detect_environment({**SLURM, "DDPKIT_CLUSTER_ENV": "local"})) is LocalEnvironment
    assert type(detect_environment({**SLURM, "DDPKIT_CLUSTER_ENV": "SLURM"})) is SLURMEnvironment
    assert type(detect_environment({**SLURM, "DDPKIT_CLUSTER_ENV": "auto"})) is SLURMEnvironment


def test_override_with_an_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"DDPKIT_CLUSTER_ENV='pbs' .*auto, torchelastic, kubeflow"):
        detect_environment({"DDPKIT_CLUSTER_ENV": "pbs"})


def test_forced_environment_still_validates_its_variables() -> None:
    with pytest.raises(ClusterEnvironmentError, match=r"SLURM environment is half-set"):
        detect_environment({"DDPKIT_CLUSTER_ENV": "slurm"})


def test_detect_environment_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    env = detect_environment()
    assert type(env) is SLURMEnvironment
    assert env.global_rank() == 6


def test_as_dict_is_json_and_names_the_environment() -> None:
    data = json.loads(json.dumps(SLURMEnvironment(SLURM).as_dict()))
    assert data == {
        "environment": "slurm",
        "master_addr": "gpu003",
        "master_port": 19567,
        "world_size": 8,
        "global_rank": 6,
        "local_rank": 2,
        "node_rank": 1,
        "local_world_size": None,
        "master_addr_source": "the first host of SLURM_JOB_NODELIST='gpu[003-004]'",
        "creates_processes_externally": True,
    }


def test_the_local_master_address_says_where_it_came_from() -> None:
    from ddpkit.environments import LocalEnvironment

    assert LocalEnvironment({"MASTER_ADDR": "10.0.0.7"}).master_address_source() == "MASTER_ADDR"
    unset = LocalEnvironment({})
    assert unset.master_address() == "127.0.0.1"
    assert unset.master_address_source() == "the default (MASTER_ADDR is not set)"
