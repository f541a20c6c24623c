"""The CUDA and NCCL paths, on a real GPU (skipped without one; ``tools/gpu-check.sh`` runs them).

One GPU is enough for most: NCCL with world size 1, and two ranks that share the
GPU under gloo with CUDA tensors (NCCL refuses two ranks on one device). What
needs two GPUs (NCCL between ranks, a hang under NCCL) skips with that reason.
Each job is a function of ``tests/gpu/cuda_jobs.py``, which also runs on CPU.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit import HangError, launch
from tests.gpu import cuda_jobs

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL runs one rank per GPU: two ranks need two GPUs")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _check_collectives(found: dict[str, Any], rank: int, world: int, device: str) -> None:
    assert found["gather"] == [(device, [float(i) for i in range(r + 2)]) for r in range(world)]
    assert found["mean"] == (device, sum(range(1, world + 1)) / world)
    assert found["objects"] == [(r, device, [float(r)] * 2) for r in range(world)]
    assert found["dict"] == (device, [sum(range(1, world + 1)), 3])
    assert found["dict_default"] == "cpu", "OML's sync_dicts_ddp concatenates on device='cpu' unless told"
    assert found["moved"] == [device, device, "label"]


def test_nccl_with_one_rank_sets_the_device_first_and_gives_results_back_on_it() -> None:
    found = launch(cuda_jobs.collectives, nprocs=1, backend="nccl")[0]
    assert (found["backend"], found["collective_device"], found["current_device"]) == ("nccl", "cuda:0", 0)
    _check_collectives(found, 0, 1, "cuda:0")


def test_two_ranks_sharing_one_gpu_under_gloo_get_cuda_results_back_on_their_device() -> None:
    results = launch(cuda_jobs.collectives, nprocs=2, backend="gloo")
    for rank, found in results.items():
        assert found["collective_device"] == "cpu", "gloo carries the bytes through host memory"
        _check_collectives(found, rank, 2, f"cuda:{rank % GPUS}")


@two_gpus
def test_nccl_between_two_gpus() -> None:
    results = launch(cuda_jobs.collectives, nprocs=2, backend="nccl")
    for rank, found in results.items():
        assert (found["collective_device"], found["current_device"]) == (f"cuda:{rank}", rank)
        _check_collectives(found, rank, 2, f"cuda:{rank}")


@pytest.mark.parametrize("hook", [None, "fp16", "bf16", "powersgd"])
def test_ddp_plugin_puts_the_model_on_its_gpu_and_the_compressing_hooks_run(hook: str | None) -> None:
    nprocs = min(GPUS, 2)
    plain = launch(cuda_jobs.ddp_plugin_step, None, nprocs=nprocs, backend="nccl")[0]
    hooked = launch(cuda_jobs.ddp_plugin_step, hook, nprocs=nprocs, backend="nccl")[0]
    assert hooked["device"] == "cuda:0"
    tolerance = {None: 0.0, "fp16": 2e-3, "bf16": 2e-2, "powersgd": 0.0}[hook]  # PowerSGD: exact before its start
    assert len(hooked["grads"]) == len(plain["grads"])
    assert all(math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance) for a, b in zip(hooked["grads"],
               plain["grads"], strict=True))  # fmt: skip


def test_train_loop_trains_on_cuda_local_rank() -> None:
    found = launch(cuda_jobs.train_loop, 3, nprocs=1, backend="nccl")[0]
    assert found["device"] == "cuda:0"
    assert found["history"]["validation_accuracy"][-1] > 0.85, found["history"]


@pytest.mark.parametrize(
    "options", [{}, {"gradient_clip_norm": 0.3, "precision": "bf16-mixed"}], ids=["plain", "clip-bf16"]
)
def test_a_train_loop_step_never_waits_for_the_gpu(options: dict[str, Any]) -> None:
    """CUDA's sync debug mode at "error" from step 3 to 20 (one process under NCCL: DDP with one rank): nothing in a
    step synchronises with the device, and no host read is counted."""
    found = launch(cuda_jobs.train_loop_never_syncs, options, nprocs=1, backend="nccl")[0]
    assert found == {"device": "cuda:0", "reads": 0.0}


def test_a_fault_tolerant_train_loop_of_two_replica_groups_trains_on_the_gpu_as_one_process_does(
    tmp_path: Path,
) -> None:
    """Two torchft replica groups sharing the GPU (gloo between them, with CUDA gradients): each trains on
    ``cuda:0``, and the weights handed back are those of one process trained on the same global batches."""
    pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")
    found = cuda_jobs.fault_tolerant_fit(str(tmp_path), 2)
    assert found["devices"] == {"group-0.device": "cuda:0", "group-1.device": "cuda:0"}, found
    assert found["reference_device"] == "cuda:0"
    assert found["history"]["validation_accuracy"][-1] > 0.85, found["history"]
    assert found["gap"] < 1e-4, found


def test_the_flight_recorder_is_on_with_ddpkits_buffer_size_under_nccl() -> None:
    nprocs = min(GPUS, 2)
    found = launch(cuda_jobs.flight_recorder, nprocs=nprocs, backend="nccl")[0]
    preset = {name: os.environ.get(name) for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    if any(preset.values()):  # a size the machine or the user set is kept
        assert {name: found[name] for name in preset} == preset
    elif nprocs == 1:  # one rank waits for nobody: no hang watchdog, so no recorder either
        assert found["TORCH_FR_BUFFER_SIZE"] is None
    else:
        assert found["TORCH_FR_BUFFER_SIZE"] == "256"


def test_a_stream_ends_together_through_cuda_collectives() -> None:
    assert launch(cuda_jobs.stream_ends, nprocs=1, backend="nccl")[0] == [10]
    assert launch(cuda_jobs.stream_ends, nprocs=2, backend="gloo")[0] == [5, 5]


def test_ddpkit_doctor_runs_under_nccl() -> None:
    from ddpkit.doctor import check_ranks

    report = launch(check_ranks, nprocs=1, backend="nccl", peer_timeout=10.0)[0]
    assert report is not None
    assert (report.backend, report.world_size) == ("nccl", 1)
    assert report.measurements, "the collectives were timed"


def straggler() -> None:
    """Rank 1 never reaches the all-reduce that rank 0 waits in."""
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    tensor = torch.ones(1, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()


@two_gpus
def test_a_hang_under_nccl_is_reported_naming_the_rank_that_did_not_arrive() -> None:
    """ddpkit's watchdog (10 s) reports before NCCL's own timeout (its default 10 minutes, plus 60 s)."""
    with pytest.raises(HangError, match=r"rank 1") as caught:
        launch(straggler, nprocs=2, backend="nccl", timeout=10)
    assert "all_reduce" in str(caught.value)
