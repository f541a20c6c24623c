"""Per-step fault tolerance on torchft: replica groups that lose one and go on in the same processes.

Here, the tests that need no process; the others are in tests/ranks/test_fault_tolerance.py and
tests/e2e/test_fault_tolerance.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.errors import DDPKitError, RendezvousFailedError
from ddpkit.fault_tolerance import TorchFT, serve_lighthouse
from ddpkit.fault_tolerance._torchft import torchft_module, url_host
from ddpkit.training._replica_groups import _honoured
from tests.helpers import JOB_SECRET
from tests.support.fault_tolerance import _digits_loop

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

# The survivors' steps after a kill must outlast a restarted group's start (Python, torch and torchft: 7-9 s on
# the 2-core machine, 20 s and more on a loaded CI machine), else they finish before it is back: 260 steps of
# about 0.08 s; the groups that outlive a kill wait for the restarted one a little after it (FT_WAIT_AT, see
# tests/e2e/ft_replica.py and _survivors_wait_for_the_restart).


def test_a_missing_torchft_is_named_with_the_install_command() -> None:
    with pytest.raises(ImportError, match=r"install it with pip install torchft==0\.2\.0 \(ddpkit's ft extra\)"):
        torchft_module("torchft_that_does_not_exist")


def test_lighthouse_addresses_are_read_with_ipv6_brackets() -> None:
    assert [url_host(a) for a in ("http://[::1]:29510", "http://127.0.0.1:1/x", "node1:29510")] == [
        "::1", "127.0.0.1", "node1"
    ]  # fmt: skip


def test_a_lighthouse_on_an_address_that_is_not_this_machines_names_the_addresses_it_has() -> None:
    with pytest.raises(RendezvousFailedError, match=r"192\.0\.2\.1.*this machine's addresses are"):
        serve_lighthouse("192.0.2.1")  # TEST-NET-1: never this machine's


def _callback_events(fault_tolerance: Any, checkpoint_dir: Path) -> list[tuple[str, int]]:
    """(event, epoch) of every callback call but on_batch_end, over fit(1) and then fit(2) resumed from the
    checkpoint, of a loop on a tenth of the digits."""
    from torch.utils.data import DataLoader, Subset

    from ddpkit import Callback
    from ddpkit.examples.digits import digits_datasets

    events: list[tuple[str, int]] = []

    class Events(Callback):
        def on_train_begin(self, train_loop: Any) -> None:
            events.append(("train_begin", train_loop.epoch))

        def on_epoch_begin(self, train_loop: Any) -> None:
            events.append(("epoch_begin", train_loop.epoch))

        def on_epoch_end(self, train_loop: Any) -> None:
            events.append(("epoch_end", train_loop.epoch))

        def on_train_end(self, train_loop: Any) -> None:
            events.append(("train_end", train_loop.epoch))

    train_set, _ = digits_datasets(seed=0)
    for epochs in (1, 2):
        loader = DataLoader(Subset(train_set, range(128)), batch_size=16)
        _digits_loop(loader=loader, fault_tolerance=fault_tolerance, global_batch_size=32,
                     checkpoint_dir=str(checkpoint_dir)).fit(epochs, callbacks=[Events()])  # fmt: skip
    return events


def _stopped_mid_epoch(fault_tolerance: Any, max_steps: int | None = None) -> tuple[int, int, list[float], float]:
    """(steps taken, epochs ended, train losses, last step's loss) of fit(3) on a tenth of the digits (4 steps an
    epoch) whose callback sets should_stop after step 2; with ``max_steps``, fit(3, max_steps=...) without it."""
    from torch.utils.data import DataLoader, Subset

    from ddpkit import Callback
    from ddpkit.examples.digits import digits_datasets

    class StopAtTwo(Callback):
        def on_batch_end(self, train_loop: Any) -> None:
            train_loop.should_stop = train_loop.should_stop or train_loop.global_step == 2

    train_set, _ = digits_datasets(seed=0)
    loader = DataLoader(Subset(train_set, range(128)), batch_size=16)
    torch.manual_seed(0)  # the same first weights in every run
    loop = _digits_loop(loader=loader, fault_tolerance=fault_tolerance, global_batch_size=32)
    history = loop.fit(3, callbacks=None if max_steps else [StopAtTwo()], max_steps=max_steps)
    return loop.global_step, loop.epoch, history.get("train_loss", []), loop.step_loss


def test_a_fault_tolerant_trainloop_calls_the_callbacks_when_the_ddp_loop_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once per epoch trained, on_epoch_begin before its first step (also when a checkpoint resumes it), as
    the DDP loop; should_stop set in the middle of an epoch ends fit after that step, as in the DDP loop; one
    group alone in its quorum, in this process."""
    from ddpkit._trust.secret import SECRET_VARIABLE, new_job_secret

    monkeypatch.setenv(SECRET_VARIABLE, new_job_secret().decode())
    plain = _callback_events(None, tmp_path / "plain")
    plain_stop = _stopped_mid_epoch(None)
    with serve_lighthouse("127.0.0.1", min_replicas=1) as lighthouse:  # one job; its fit resumed is the same job
        tolerant = _callback_events(TorchFT(lighthouse.address, "r0", timeout=10), tmp_path / "ft")
    with serve_lighthouse("127.0.0.1", min_replicas=1) as lighthouse:  # a new job: a lighthouse of its own
        tolerant_stop = _stopped_mid_epoch(TorchFT(lighthouse.address, "r0", timeout=10))
    plain_budget = _stopped_mid_epoch(None, max_steps=6)
    with serve_lighthouse("127.0.0.1", min_replicas=1) as lighthouse:
        tolerant_budget = _stopped_mid_epoch(TorchFT(lighthouse.address, "r0", timeout=10), max_steps=6)
    assert plain == [("train_begin", 0), ("epoch_begin", 0), ("epoch_end", 0), ("train_end", 1),
                     ("train_begin", 1), ("epoch_begin", 1), ("epoch_end", 1), ("train_end", 2)]  # fmt: skip
    assert tolerant == plain
    assert plain_stop[:3] == (2, 0, []), "the DDP loop stops after the step in which it was stopped"
    assert tolerant_stop[:3] == plain_stop[:3]
    assert tolerant_stop[3] == pytest.approx(plain_stop[3], rel=1e-6)
    assert plain_budget[:2] == (6, 1), "max_steps=6: one epoch of 4 steps, then 2 of the second"
    assert tolerant_budget[:2] == plain_budget[:2]
    assert tolerant_budget[2] == pytest.approx(plain_budget[2], rel=1e-6)
    assert tolerant_budget[3] == pytest.approx(plain_budget[3], rel=1e-6)


def test_a_fault_tolerant_trainloop_shows_its_progress_and_says_its_epochs_in_the_writing_group(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """progress=True under fault tolerance: a bar of the epoch's items (the runner's, as under DDP) and the epoch's
    line, named by the group."""
    from torch.utils.data import DataLoader, Subset

    from ddpkit._trust.secret import SECRET_VARIABLE, new_job_secret
    from ddpkit.examples.digits import digits_datasets

    monkeypatch.setenv(SECRET_VARIABLE, new_job_secret().decode())
    train_set, _ = digits_datasets(seed=0)
    loader = DataLoader(Subset(train_set, range(128)), batch_size=16)
    with serve_lighthouse("127.0.0.1") as lighthouse:
        settings = TorchFT(lighthouse.address, "r0", timeout=10)
        _digits_loop(loader=loader, fault_tolerance=settings, global_batch_size=32, progress=True).fit(1)
    out, err = capsys.readouterr()
    assert "[r0] epoch  1/1  train loss" in out
    assert "[r0] epoch 1/1" in err, err[-500:]
    assert "/128 [" in err, "a bar of the epoch's 128 items"
    assert "item/s" in err


def test_fault_tolerance_settings_come_from_torchfts_variables_and_missing_ones_are_named() -> None:
    torchfts = {"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9", "REPLICA_GROUP_ID": "g1"}
    settings = TorchFT(min_replicas=2).resolved({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9", "REPLICA_GROUP_ID": "g1"})
    assert (settings.lighthouse, settings.replica_id, settings.min_replicas) == ("http://127.0.0.1:9", "g1", 2)
    assert TorchFT("http://h:1", "mine").resolved({"REPLICA_GROUP_ID": "other"}).replica_id == "mine"
    with pytest.raises(ValueError, match=r"replica_id \(or \$REPLICA_GROUP_ID\)") as missing:
        TorchFT().resolved({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:9"})
    assert "lighthouse" not in str(missing.value).split("needs")[1].split(":")[0]
    with pytest.raises(ValueError, match=r"lighthouse \(or \$TORCHFT_LIGHTHOUSE\) and replica_id"):
        TorchFT().resolved({})
    assert TorchFT().resolved({**torchfts, "DDPKIT_REPLICA_GROUPS": "3"}).replica_groups == 3
    assert TorchFT(replica_groups=2).resolved({**torchfts, "DDPKIT_REPLICA_GROUPS": "3"}).replica_groups == 2
    assert TorchFT().resolved(torchfts).replica_groups is None
    with pytest.raises(ValueError, match=r"\$DDPKIT_REPLICA_GROUPS='three' must be a whole number"):
        TorchFT().resolved({**torchfts, "DDPKIT_REPLICA_GROUPS": "three"})
    for bad in ({"min_replicas": 0}, {"min_replicas": True}, {"timeout": 0}, {"quorum_timeout": float("inf")},
                {"replica_groups": 0}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            TorchFT(**bad)  # type: ignore[arg-type]


def test_the_jobs_first_step_waits_for_all_its_replica_groups_then_starts_without_those_that_never_come(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With replica_groups=2 the first group's first quorum waits (here 2 s) for the second, so that neither
    trains a step alone that the other would do again; after quorum_timeout it starts with those that came."""
    import threading

    from ddpkit._trust.secret import SECRET_VARIABLE, new_job_secret
    from ddpkit.fault_tolerance import ReplicaGroup

    monkeypatch.setenv(SECRET_VARIABLE, new_job_secret().decode())
    models = {name: torch.nn.Linear(2, 1) for name in ("g0", "g1", "alone")}
    seen: dict[str, tuple[float, tuple[str, ...], int]] = {}

    def join(lighthouse: str, name: str, quorum_timeout: float = 30.0) -> ReplicaGroup:
        model = models[name]
        return ReplicaGroup(lighthouse, name, model.state_dict, model.load_state_dict, timeout=10,
                            quorum_timeout=quorum_timeout, replica_groups=2)  # fmt: skip

    def first_step(group: ReplicaGroup, name: str) -> None:
        group.start_step()
        members = group.members  # waits for the step's quorum
        seen[name] = (time.monotonic(), members, group.step)
        group.commit()

    with serve_lighthouse("127.0.0.1") as lighthouse:
        first = join(lighthouse.address, "g0")
        waiting = threading.Thread(target=first_step, args=(first, "g0"))
        waiting.start()
        time.sleep(2.0)
        assert "g0" not in seen, f"the first group started alone: {seen}"
        second = join(lighthouse.address, "g1")
        joined = time.monotonic()
        first_step(second, "g1")
        waiting.join(30)
        for group in (first, second):
            group.close()
    assert seen["g0"][1] == seen["g1"][1] == ("g0", "g1")
    assert seen["g0"][0] > joined, "the first group's first step did not wait for the second"
    assert seen["g0"][2] == seen["g1"][2] == 0
    with serve_lighthouse("127.0.0.1") as lighthouse, caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
        alone = join(lighthouse.address, "alone", quorum_timeout=1.0)
        started = time.monotonic()
        first_step(alone, "alone")
        alone.close()
    assert seen["alone"][1] == ("alone",)
    assert seen["alone"][0] - started >= 1.0, "it did not wait for the second group"
    assert "the job starts with 1 of its 2 replica groups (alone): the others did not join within 1 s" in caplog.text


def test_a_trainloop_with_fault_tolerance_needs_a_global_batch_and_its_own_process_per_group() -> None:
    with pytest.raises(ValueError, match="fault_tolerance needs global_batch_size"):
        _digits_loop(fault_tolerance="torchft")
    with pytest.raises(ValueError, match=r"fault_tolerance='ft': use None, 'torchft'"):
        _digits_loop(fault_tolerance="ft", global_batch_size=64)
    loop = _digits_loop(fault_tolerance="torchft", global_batch_size=64)
    assert loop.fault_tolerance == TorchFT()


def test_a_fault_tolerant_trainloop_refuses_a_batch_sampler_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils.data import DataLoader

    from ddpkit.examples.digits import digits_datasets

    class Pairs:  # a batch sampler of the user's own: batches of 2 items, then 3
        def __iter__(self) -> Any:
            return iter([[0, 1], [2, 3, 4]])

        def __len__(self) -> int:
            return 2

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:9")
    monkeypatch.setenv("REPLICA_GROUP_ID", "r0")
    train_set, _ = digits_datasets(seed=0)
    batches = Pairs()
    loop = _digits_loop(loader=DataLoader(train_set, batch_sampler=batches), fault_tolerance="torchft",
                        global_batch_size=64)  # fmt: skip
    with pytest.raises(ValueError, match="has a batch sampler: build it with batch_size="):
        loop.fit(1)


# --- TrainLoop(fault_tolerance=...): the step plan survives a change of quorum ----------------------------


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29510"], "--nnodes 1:2 (one replica group a node"),
        (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT, the same on every node: where the lighthouse listens"),
        (
            ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "--group-size", "2"],
            "--group-size 2 (with several nodes, each node's",
        ),
        (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29510"], "needs the job secret: its lighthouse and its"),
        (["--replica-id", "a"], "--replica-id names a node's group: it goes with --fault-tolerance --nnodes N"),
    ],
)
def test_ddpkit_run_fault_tolerance_on_several_nodes_names_what_it_lacks(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddpkit._trust.secret import SECRET_VARIABLE
    from ddpkit.cli import main

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    assert main(["run", "--fault-tolerance", "-n", "2", *arguments, "tests/e2e/ft_trainloop.py"]) == 2
    assert said in capsys.readouterr().err


_OPEN_MPI_TASK = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}  # fmt: skip
_SLURM_TASK = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_JOB_ID": "77",
               "SLURM_JOB_NODELIST": "localhost,127.0.0.1"}  # fmt: skip


@pytest.mark.parametrize(
    ("task", "nnodes", "said"),
    [  # one task a node: it goes on (to the next thing it lacks, the secret); several a node: refused
        ({**_OPEN_MPI_TASK, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "2", "needs the job secret"),
        ({**_SLURM_TASK, "SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "1(x2)"}, "2", "needs the job secret"),
        ({**_OPEN_MPI_TASK, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "2", "not as one of several tasks of mpi on a node"),
        (
            {
                **_SLURM_TASK,
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "0",
                "SLURM_TASKS_PER_NODE": "2",
                "SLURM_JOB_NODELIST": "localhost",
            },
            "2",
            "not as one of several tasks of slurm on a node",
        ),
        ({**_OPEN_MPI_TASK, "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, "1", "run it as one task a node with --nnodes"),
    ],
)
def test_ddpkit_run_fault_tolerance_under_srun_or_mpirun_takes_one_task_a_node(
    task: dict[str, str], nnodes: str, said: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    from ddpkit._trust.secret import SECRET_VARIABLE
    from ddpkit.cli import main

    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    arguments = ["--nnodes", nnodes, "--rdzv-endpoint", "127.0.0.1:29510"]
    assert main(["run", "--fault-tolerance", "-n", "2", *arguments, "tests/e2e/ft_trainloop.py"]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--fault-tolerance", "-n", "3", "--group-size", "2"], "--group-size 2 with -n 3: the -n processes make"),
        (["--fault-tolerance", "-n", "2", "--group-size", "0"], "--group-size 0 with -n 2"),
        (["-n", "4", "--group-size", "2"], "--group-size 2 is for --fault-tolerance's replica groups"),
    ],
)
def test_ddpkit_run_refuses_replica_groups_that_do_not_divide_its_processes(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpkit.cli import main

    assert main(["run", *arguments, "tests/e2e/ft_trainloop.py"]) == 2
    assert said in capsys.readouterr().err


def test_the_log_names_who_left_who_joined_and_who_came_back_as_a_new_process(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from ddpkit.training._fault_tolerant import FaultTolerantSteps

    fit = SimpleNamespace(settings=TorchFT(replica_id="group-0"), _processes=(), _members=(), rank=0)
    other_rank = SimpleNamespace(settings=TorchFT(replica_id="group-0"), _processes=(), _members=(), rank=1)
    steps = [("group-0:a", "group-1:b", "group-2:c"), ("group-0:a", "group-1:d", "group-2:c"),
             ("group-0:a", "group-2:c"), ("group-0:a", "group-2:c", "group-3:e")]  # fmt: skip
    with caplog.at_level("WARNING", logger="ddpkit.training._fault_tolerant"):
        for step, processes in enumerate(steps):
            FaultTolerantSteps._note_members(fit, processes, step)  # type: ignore[arg-type]
            FaultTolerantSteps._note_members(other_rank, processes, step)  # type: ignore[arg-type]  # says nothing
    assert [record.getMessage() for record in caplog.records] == [
        "replica group group-0 at step 2: group-1 came back as a new process (it had died); the quorum is now "
        "group-0, group-1, group-2",
        "replica group group-0 at step 3: group-1 left the quorum (lost, hung, or late for the step's quorum); "
        "the quorum is now group-0, group-2",
        "replica group group-0 at step 4: group-3 joined; the quorum is now group-0, group-2, group-3",
    ]
    assert fit._members == other_rank._members == ("group-0", "group-2", "group-3")


def test_torchfts_tracebacks_go_to_debug_and_a_failed_step_keeps_its_cause_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from ddpkit.fault_tolerance._torchft_log import QuietTorchft as _QuietTorchft
    from ddpkit.fault_tolerance._torchft_log import first_line as _first_line

    try:
        raise RuntimeError("[/w/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:11677: reset\nat ...")
    except RuntimeError as exc:
        error, failed = exc, logging.LogRecord("torchft.manager", logging.ERROR, "m.py", 1, "got exception", None,
                                               sys.exc_info())  # fmt: skip
    assert _first_line(error) == "RuntimeError: Read error [127.0.0.1]:11677: reset"
    with caplog.at_level(logging.DEBUG, logger="ddpkit.fault_tolerance._replica"):
        assert not _QuietTorchft(nccl=True).filter(failed), "torchft's traceback is not printed at ERROR"
    assert [(r.levelno, r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        (logging.DEBUG, "torchft: got exception", True)
    ]
    try:
        raise DDPKitError("rank 2 (replica group 'stranger' at 127.0.0.1:4) holds no job secret")
    except DDPKitError:
        refused = logging.LogRecord("torchft.manager", logging.ERROR, "m.py", 1, "got exception in pg configure",
                                    None, sys.exc_info())  # fmt: skip
    assert _QuietTorchft(nccl=True).filter(refused), "ddpkit's own refusal names who failed the proof"
    assert (refused.exc_info, refused.getMessage()) == (None, "got exception in pg configure")
    flight = logging.LogRecord("torchft.manager", logging.WARNING, "m.py", 1, "Unable to reset NCCL flight "
                               "recorder", None, None)  # fmt: skip
    assert (_QuietTorchft(nccl=False).filter(flight), _QuietTorchft(nccl=True).filter(flight)) == (False, True)


def test_fit_distributed_with_fault_tolerance_refuses_what_it_cannot_honour() -> None:
    loop = _digits_loop(fault_tolerance="torchft", global_batch_size=64)
    with pytest.raises(ValueError, match=r"cannot honour nnodes='1:2' \(one replica group a node: a whole number"):
        loop.fit_distributed(1, nnodes="1:2")
    with pytest.raises(ValueError, match=r"nnodes=2 without rdzv_endpoint HOST:PORT, the same on every node"):
        loop.fit_distributed(1, nnodes=2)
    with pytest.raises(ValueError, match=r"rdzv_endpoint='127.0.0.1:1' \(the lighthouse of a job on several nodes\)"):
        loop.fit_distributed(1, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(ValueError, match=r"cannot honour rdzv_conf=") as refused:
        loop.fit_distributed(1, backend="nccl", start_method="fork", rdzv_conf={"x": 1}, timeout=0)
    for named in ("backend='nccl'", "start_method='fork'", "rdzv_conf={'x': 1}", "timeout=0 (a fault-tolerant step"):
        assert named in str(refused.value)


def test_fit_distributed_with_fault_tolerance_honours_gloo_and_the_timeout() -> None:
    arguments = {"grad_accumulation": 1, "nnodes": 1, "rdzv_endpoint": None, "rdzv_conf": None, "start_method": "spawn"}
    settings = _honoured(TorchFT(min_replicas=2), backend="gloo", timeout=12.5, **arguments)
    assert settings == TorchFT(min_replicas=2, timeout=12.5), "the step's deadline, as DDP's hang timeout"
    assert _honoured(TorchFT(timeout=7), backend=None, timeout=None, **arguments) == TorchFT(timeout=7)


def test_a_nodes_command_warns_when_its_ranks_outnumber_its_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ddpkit.fault_tolerance import _job

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # mpirun bound the task to one core
    assert _job._crowded(4) == (
        "this command may run on 1 of the machine's 8 cores (its CPU affinity) and its 4 ranks share them: give "
        "the task the node's cores (srun --cpus-per-task N; mpirun --bind-to none)"
    )
    assert _job._crowded(1) == "", "one rank on one core"
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert _job._crowded(16) == "", "every core of the machine: nothing to give"


def test_a_lighthouse_host_whose_name_resolves_to_loopback_here_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Debian maps a machine's own name to 127.0.1.1: a lighthouse there would be out of the other nodes' reach,
    and this node would wait for one that nobody serves."""
    import socket

    from ddpkit._trust.secret import SECRET_VARIABLE
    from ddpkit.cli import main

    resolve = socket.getaddrinfo

    def own_name_on_loopback(host: str, *args: Any, **kwargs: Any) -> Any:
        return resolve("127.0.1.1" if host == "node001" else host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", own_name_on_loopback)
    monkeypatch.setenv(SECRET_VARIABLE, JOB_SECRET)
    arguments = ["--nnodes", "2", "--rdzv-endpoint", "node001:29510"]
    assert main(["run", "--fault-tolerance", "-n", "1", *arguments, "tests/e2e/ft_trainloop.py"]) == 2
    said = "--rdzv-endpoint node001:29510: node001 resolves to 127.0.1.1 here, a loopback address that the other"
    assert said in capsys.readouterr().err
    assert main(["lighthouse", "--host", "node001", "--port", "29510"]) == 1
    said = "this node is to host torchft's lighthouse at node001, but node001 resolves to 127.0.1.1, a loopback"
    assert said in capsys.readouterr().err


def test_a_lighthouse_port_taken_by_something_else_is_named_and_one_that_a_lighthouse_holds_is_joined(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from ddpkit._trust.secret import SECRET_VARIABLE
    from ddpkit.cli import main
    from ddpkit.fault_tolerance._job import _lighthouse_here

    monkeypatch.setenv(SECRET_VARIABLE, JOB_SECRET)
    with socket.socket() as other:  # a program of its own on the port: not torchft's lighthouse
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        arguments = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        assert main(["run", "--fault-tolerance", "-n", "1", *arguments, "tests/e2e/ft_trainloop.py"]) == 1
    said = f"--rdzv-endpoint 127.0.0.1:{port}: the port is taken by a process that does not answer as torchft's"
    assert said in capsys.readouterr().err
    with serve_lighthouse("127.0.0.1") as served:  # a second "node" of this machine: the first one serves it
        port = int(served.address.rpartition(":")[2])
        assert _lighthouse_here("127.0.0.1", port, min_replicas=1, secret=JOB_SECRET.encode()) is None


def test_a_quorum_that_does_not_form_in_time_is_asked_for_again_before_the_group_gives_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """torchft's manager raises a quorum's timeout from the next step's start, which ends the group's process: the
    group asks its manager again, up to QUORUM_ATTEMPTS times, saying so, and records the quorum that came."""
    from types import SimpleNamespace

    from ddpkit.fault_tolerance._manager import QUORUM_ATTEMPTS, SeenQuorum, _RecordingClient
    from ddpkit.fault_tolerance._quorums import ACCEPT

    class Slow:
        def __init__(self, timeouts: int) -> None:
            self.timeouts, self.asked = timeouts, 0

        def _quorum(self, **kwargs: Any) -> Any:
            self.asked += 1
            if self.asked <= self.timeouts:
                raise TimeoutError('status: Cancelled, message: "Timeout expired"')
            return SimpleNamespace(replica_ids=["g0:a", "g1:b"], max_step=7)

    seen = SeenQuorum()
    slow = Slow(QUORUM_ATTEMPTS - 1)
    with caplog.at_level("WARNING", "ddpkit.fault_tolerance"):
        quorum = _RecordingClient(slow, seen, "g0", lambda quorum: ACCEPT)._quorum(timeout=1)
    assert quorum.replica_ids == ["g0:a", "g1:b"]
    assert (slow.asked, seen) == (QUORUM_ATTEMPTS, SeenQuorum(["g0:a", "g1:b"], 7))
    assert f"replica group g0: no quorum formed within quorum_timeout (status: Cancelled, message: \"Timeout " \
           f"expired\"); asking again (2 of {QUORUM_ATTEMPTS})" in caplog.text  # fmt: skip
    never = Slow(QUORUM_ATTEMPTS)
    with pytest.raises(TimeoutError, match="Timeout expired"):
        _RecordingClient(never, SeenQuorum(), "g0", lambda quorum: ACCEPT)._quorum(timeout=1)
    assert never.asked == QUORUM_ATTEMPTS


def test_fit_distributed_on_a_node_whose_group_came_back_too_late_says_so_instead_of_a_failed_exit_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This node's group ended with status 0 and no result (started again after the other groups finished, it
    trained nothing): the caller is told that, not that a group "exited with status 0"."""
    from ddpkit import WorkerFailedError
    from ddpkit.training import _replica_groups

    monkeypatch.setattr(_replica_groups, "run_node_group", lambda *args, **kwargs: 0)
    loop = _digits_loop(fault_tolerance=TorchFT(replica_id="node-b"), global_batch_size=64)
    arguments = {"grad_accumulation": 1, "backend": None, "timeout": None, "nnodes": 2,
                 "rdzv_endpoint": "10.0.0.1:29510", "rdzv_conf": None, "start_method": "spawn"}  # fmt: skip
    with pytest.raises(WorkerFailedError, match="started again after the job's other groups had finished, it "
                       "trained nothing") as caught:  # fmt: skip
        _replica_groups.fit_replica_groups(loop, TorchFT(replica_id="node-b"), 1, 2, None, 0, **arguments)
    assert "exited with status 0" not in str(caught.value)
