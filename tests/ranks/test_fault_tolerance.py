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
from tests.unit.test_fault_tolerance import _digits_loop

torchft = pytest.importorskip("torchft", reason="the ft extra (torchft) is not installed")

# The survivors' steps after a kill must outlast a restarted group's start (Python, torch and torchft: 7-9 s on
# the 2-core machine, 20 s and more on a loaded CI machine), else they finish before it is back: 260 steps of
# about 0.08 s; the groups that outlive a kill wait for the restarted one a little after it (FT_WAIT_AT, see
# tests/e2e/ft_replica.py and _survivors_wait_for_the_restart).


def test_a_fault_tolerant_trainloop_loads_ahead_with_the_training_loaders_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One group alone, in this process, with num_workers=2 and 0: no warning, every step's share but each
    epoch's first comes from the workers, and the same weights to the bit."""
    import warnings
    from collections import Counter

    from torch.utils.data import DataLoader, Subset

    from ddpkit._secret import SECRET_VARIABLE, new_job_secret
    from ddpkit.examples.digits import digits_datasets
    from ddpkit.training._ahead import AheadLoader

    monkeypatch.setenv(SECRET_VARIABLE, new_job_secret().decode())
    counts: Counter[str] = Counter()
    original = AheadLoader.share

    def counted(self: AheadLoader, *args: int) -> list[Any] | None:
        loaded = original(self, *args)
        counts["workers" if loaded is not None else "here"] += 1
        return loaded

    monkeypatch.setattr(AheadLoader, "share", counted)
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
    assert counts == {"here": 2, "workers": 14}, "8 steps an epoch: its first loaded here, then ahead"
    assert all(torch.equal(weights[0][name], value) for name, value in weights[2].items())
