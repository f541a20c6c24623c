"""Process-group helpers: backend choice, idempotent init, rank helpers, rank_zero_first, seeding.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_process_group.py.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddpkit import (
    DDPKitError,
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    is_ddp,
    is_distributed,
    rank_zero_first,
    rank_zero_only,
    seed_everything,
)
from ddpkit._backends import backend_threads as _backend_threads
from ddpkit.process_group import collective_device
from ddpkit.testing import run_parallel

# --- with a process group (pool) -----------------------------------------------------------


def _ranks_and_devices() -> tuple[int, int, int, str, bool]:
    barrier()
    return get_rank(), get_world_size(), get_local_rank(), str(collective_device()), is_distributed()


def test_rank_helpers_in_a_group() -> None:
    assert run_parallel(_ranks_and_devices, world_size=3) == [(r, 3, r, "cpu", True) for r in range(3)]
    assert run_parallel(is_ddp) == [True, True], "OML's name"
    assert is_ddp() is False


def _rank_zero_goes_first(directory: str) -> bool:
    marker = Path(directory) / "written-by-rank-0"
    with rank_zero_first():
        if get_rank() == 0:
            time.sleep(0.3)  # if the others were not waiting, they would miss the file
            marker.write_text("ready")
            return True
        return marker.exists()


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_zero_first_runs_rank_zero_before_the_others(tmp_path: Path, world_size: int) -> None:
    assert run_parallel(_rank_zero_goes_first, str(tmp_path), world_size=world_size) == [True] * world_size


def _rank_zero_fails_inside() -> tuple[str, str, float]:
    try:
        with rank_zero_first():
            if get_rank() == 0:
                raise OSError("download failed: disk full")
            body = "ran"
    except (OSError, DDPKitError) as exc:
        caught = f"{type(exc).__name__}: {exc}"
        body = "skipped"
    else:
        caught = ""
    total = torch.ones(1)
    dist.all_reduce(total)  # the group is still usable
    return caught, body, total.item()


def test_rank_zero_first_releases_and_informs_the_others_when_rank_zero_raises() -> None:
    started = time.monotonic()
    (zero, *others) = run_parallel(_rank_zero_fails_inside, world_size=3, timeout=20)
    assert time.monotonic() - started < 15, "nobody waited for the process-group timeout"
    assert zero == ("OSError: download failed: disk full", "skipped", 3.0)
    for caught, body, total in others:
        assert caught.startswith("DDPKitError: rank 0 failed inside rank_zero_first")
        assert "OSError: download failed: disk full" in caught
        assert (body, total) == ("skipped", 3.0)


@rank_zero_only
def _only_on_zero(value: int) -> int:
    return value * 2


def _call_rank_zero_only() -> int | None:
    return _only_on_zero(21)


def test_rank_zero_only_runs_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert run_parallel(_call_rank_zero_only) == [42, None]
    assert _only_on_zero(21) == 42
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _only_on_zero(21) is None, "before a group exists the environment's rank decides"


def _seeded_draws(per_rank: bool) -> tuple[int, list[float]]:
    used = seed_everything(7, per_rank=per_rank)
    return used, [random.random(), float(np.random.rand()), torch.rand(1).item()]


def test_seed_everything_seeds_every_generator_alike_or_per_rank() -> None:
    same = run_parallel(_seeded_draws, False)
    assert same[0] == same[1]
    assert same[0][0] == 7
    differ = run_parallel(_seeded_draws, True)
    assert [used for used, _ in differ] == [7, 8]
    assert differ[0][1] != differ[1][1]
    assert differ[0] == same[0], "rank 0's per-rank seed is the seed itself"
    assert _seeded_draws(False) == same[0], "same numbers in the test process"


# --- at exit ---------------------------------------------------------------------------------


def _gloo_threads_around_a_ddp_module() -> tuple[list[str], list[str]]:
    with_group = _backend_threads()
    group = dist.new_group(backend="gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1), process_group=group)
    dist.destroy_process_group(group)
    del model
    return with_group, _backend_threads()


def test_the_exit_hook_sees_the_gloo_threads_that_torch_leaves_behind() -> None:
    # The exit hook gives these threads the GIL before the interpreter finalizes; it must find them,
    # and they outlive their group once a DDP module used it (why the hook is needed at all).
    for before, after in run_parallel(_gloo_threads_around_a_ddp_module):
        assert before, "no gloo thread found in a rank with a gloo group"
        assert all(name.startswith("pt_gloo") for name in before), before
        assert len(after) > len(before), (before, after)
