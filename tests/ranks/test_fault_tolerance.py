"""Per-step fault tolerance on torchft: replica groups that lose one and go on in the same processes.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_fault_tolerance.py and
tests/e2e/test_fault_tolerance.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ddpkit.fault_tolerance import TorchFT, serve_lighthouse
from tests.support.fault_tolerance import _digits_loop

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

# The survivors' steps after a kill must outlast a restarted group's start (Python, torch and torchft: 7-9 s on
# the 2-core machine, 20 s and more on a loaded CI machine), else they finish before it is back: 260 steps of
# about 0.08 s; the groups that outlive a kill wait for the restarted one a little after it (FT_WAIT_AT, see
# tests/e2e/ft_replica.py and _survivors_wait_for_the_restart).


def test_a_fault_tolerant_trainloop_loads_ahead_with_the_training_loaders_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One group alone, in this process, with num_workers=2 and 0: no warning, every step's share comes through
    the training loader rebuilt, as planned ahead but each epoch's first, and the same weights to the bit."""
    import warnings
    from collections import Counter

    from torch.utils.data import DataLoader, Subset

    from ddpkit._trust.secret import SECRET_VARIABLE, new_job_secret
    from ddpkit.examples.digits import digits_datasets
    from ddpkit.training._ahead import ShareLoader

    monkeypatch.setenv(SECRET_VARIABLE, new_job_secret().decode())
    counts: Counter[tuple[int, str]] = Counter()
    original = ShareLoader.share

    def counted(self: ShareLoader, *args: int) -> Any:
        started = self.here
        loaded = original(self, *args)
        counts[int(self.workers), "planned again" if self.here > started else "ahead"] += 1
        return loaded

    monkeypatch.setattr(ShareLoader, "share", counted)
    train_set, _ = digits_datasets(seed=0)
    weights = {}
    for workers in (0, 2):
        loader = DataLoader(Subset(train_set, range(256)), batch_size=16, num_workers=workers)
        with serve_lighthouse("127.0.0.1", min_replicas=1) as lighthouse, warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no "workers not used" any more
            torch.manual_seed(0)  # the same initial weights
            loop = _digits_loop(loader=loader, fault_tolerance=TorchFT(lighthouse.address, "r0", timeout=10),
                                global_batch_size=32)  # fmt: skip
            loop.fit(2)
        weights[workers] = loop.model.state_dict()
    assert counts == {(workers, kind): n for workers in (0, 1) for kind, n in (("planned again", 2), ("ahead", 14))}, (
        "8 steps an epoch: its first planned then, the others ahead"
    )
    assert all(torch.equal(weights[0][name], value) for name, value in weights[2].items())


#: The job secret of the group of two ranks (and of its lighthouse, which signs the job's record with it).
_PAIR_SECRET = "a secret of this test, the same on both ranks"


def _one_group_of_two_ranks(lighthouse: str, checkpoint_dir: str, sharded: bool, samples: int
                            ) -> tuple[dict[str, torch.Tensor], list[float], float]:  # fmt: skip
    import os

    from ddpkit import DDPPlugin, FSDPPlugin
    from ddpkit._gradients import local_tensor
    from ddpkit._trust.secret import SECRET_VARIABLE
    from tests.builders import digits_loop

    os.environ[SECRET_VARIABLE] = _PAIR_SECRET
    try:
        loop = digits_loop(16, samples=samples, global_batch_size=64, checkpoint_dir=checkpoint_dir,
                           fault_tolerance=TorchFT(lighthouse, "pair", timeout=10),
                           plugin=FSDPPlugin() if sharded else DDPPlugin())  # fmt: skip
        history = loop.fit(2)
    finally:
        del os.environ[SECRET_VARIABLE]
    parameters = list(loop.model.parameters())
    held = sum(local_tensor(p).numel() for p in parameters) / sum(p.numel() for p in parameters)
    return loop.full_state_dict(), history["train_loss"], held


@pytest.mark.parametrize(("plugin", "samples"), [("ddp", 481), ("fsdp", 481), ("ddp", 449)])
def test_a_replica_group_of_two_ranks_trains_as_one_process_and_writes_its_checkpoint(
    plugin: str, samples: int, tmp_path: Path
) -> None:
    """A replica group of both ranks of a process group (each step's share dealt over its ranks, averaged over
    them and over the quorum): the weights and losses of one process with the same global batch, and the
    checkpoint written by the group's ranks together (rank 0 writes). With FSDPPlugin each rank holds half of the
    weights, and the epoch's last step (33 items: 2 batches on rank 0, 1 on rank 1) runs a batch that counts
    nothing on rank 1, whose forward and backward take part in the sharded model's collectives. With 449 items the
    epoch's last step has one: rank 1 has no item in it and takes part with zero gradients (it failed to load an
    empty batch before)."""
    from ddpkit.testing import run_parallel
    from ddpkit.training import TrainState
    from tests.builders import digits_loop

    with serve_lighthouse("127.0.0.1", min_replicas=1, secret=_PAIR_SECRET.encode()) as lighthouse:
        (weights, losses, held), (weights_1, losses_1, held_1) = run_parallel(
            _one_group_of_two_ranks, lighthouse.address, str(tmp_path), plugin == "fsdp", samples, timeout=90
        )
    reference = digits_loop(16, samples=samples, global_batch_size=64)
    expected = reference.fit(2)["train_loss"]
    assert losses == losses_1 == pytest.approx(expected, rel=1e-6)
    assert (held, held_1) == ((0.5, 0.5) if plugin == "fsdp" else (1.0, 1.0))
    if plugin == "fsdp":
        assert weights_1 == {}, "the sharded model's whole weights go to rank 0"
    for name, value in reference.model.state_dict().items():
        assert plugin == "fsdp" or torch.equal(weights[name], weights_1[name]), "the group's ranks hold the same"
        assert float((weights[name] - value).abs().max()) < 1e-5, name
    saved = TrainState.load(tmp_path / "last.pt")
    assert (saved.epoch, saved.global_step, saved.position) == (2, 16, 0)
    assert (saved.sharded is not None) == (plugin == "fsdp")


def _fit_with_zero_under_fault_tolerance() -> str:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from tests.builders import digits_loop

    def zero(parameters: Any) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.SGD, lr=0.1)

    loop = digits_loop(16, samples=64, optimizer=zero, global_batch_size=32,
                       fault_tolerance=TorchFT("http://127.0.0.1:9", "pair", timeout=10))  # fmt: skip
    with pytest.raises(TypeError) as refused:
        loop.fit(1)
    return str(refused.value)


def test_a_replica_group_refuses_a_zero_redundancy_optimizer_on_every_rank_naming_the_way_out() -> None:
    """A recovering group takes a peer's state while the peer trains, with no collective: a
    ZeroRedundancyOptimizer (its state sharded over the group's ranks) is refused before the group joins."""
    from ddpkit.testing import run_parallel

    messages = run_parallel(_fit_with_zero_under_fault_tolerance, timeout=60)
    for message in messages:
        assert "ZeroRedundancyOptimizer" in message, message
        assert "Use the optimizer it wraps" in message, message
