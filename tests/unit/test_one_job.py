"""One job, whatever the way in: entry point x way of starting x data, each checked for the DDP invariants.

Every rank sees the world size, each training sample is used once per epoch
(up to the documented padding), rank 0 alone prints and writes the
checkpoint, and the final weights equal those of the same code in the session
pool (processes spawned with ``init_process_group(rank=, world_size=,
init_method="file://...")``), which equal ``fit_distributed``'s. The code is
``tests/e2e/one_job.py``: the pool runs its cases, and every launcher row runs it
as a script (end-to-end, one launch per row, every case in it; the two ways whose processes make
their group before any entry point run every entry point without DataLoader workers, and one case with).

Here, the tests that need no process; the others are in tests/ranks/test_one_job.py and tests/e2e/test_one_job.py.
"""

from __future__ import annotations

import pytest
from torch import nn

import ddpkit
from ddpkit.errors import ClusterEnvironmentError
from tests.e2e import one_job

# --- the rule, entry point by entry point, without processes --------------------------------------------


def _half_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher's variables without MASTER_PORT: the group cannot be made."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "DDPKIT_CLUSTER_ENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")


ENTRY_CALLS = {
    "TrainLoop.fit": lambda: one_job.make_loop("map0", None).fit(1),
    "TrainLoop.evaluate": lambda: one_job.make_loop("map0", None).evaluate(),
    "patch_dataloader_to_ddp": lambda: ddpkit.patch_dataloader_to_ddp(one_job.train_loader("map0")),
    "DDPHandler": lambda: ddpkit.DDPHandler(
        one_job._AitoolboxStyleLoop(one_job.train_loader("map0"))
    ).add_distributed_samplers(2, 1),
    "DistributedSamplerWrapper": lambda: ddpkit.DistributedSamplerWrapper(range(10)),
    "DDPPlugin.configure_ddp": lambda: ddpkit.DDPPlugin().configure_ddp(nn.Linear(2, 2), None),
    "StreamDataLoader": lambda: next(iter(ddpkit.StreamDataLoader(one_job.IndexedDigitsStream(), batch_size=4))),
    "ShardedStream": lambda: next(iter(ddpkit.ShardedStream(one_job.IndexedDigitsStream()))),
}


@pytest.mark.parametrize("entry", list(ENTRY_CALLS))
def test_every_entry_point_applies_the_rule_and_names_what_it_found(
    entry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _half_set(monkeypatch)
    with pytest.raises(ClusterEnvironmentError, match=r"WORLD_SIZE=2, RANK=1, but MASTER_PORT is not set"):
        ENTRY_CALLS[entry]()
    assert not ddpkit.is_distributed()


@pytest.mark.parametrize(
    "variables",
    [{}, {"WORLD_SIZE": "1", "RANK": "0"}, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}],
    ids=["plain python", "WORLD_SIZE=1", "one SLURM task"],
)
def test_a_process_alone_trains_in_this_process(variables: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "MASTER_PORT", "DDPKIT_CLUSTER_ENV"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**variables, "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    assert not ddpkit.ensure_dist_connection()
    loader = one_job.train_loader("map0")
    with pytest.warns(ddpkit.WarningDDP):
        assert ddpkit.patch_dataloader_to_ddp(loader) is loader
    assert not ddpkit.is_distributed()
