"""Every server listens on one address, no stranger's pickle runs (collectives, rendezvous), and a job secret
keeps strangers from joining.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_security.py and
tests/e2e/test_security.py.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from ddpkit import (
    all_gather_object,
)
from ddpkit.testing import run_parallel
from tests.support.security import _Exploit

# 127.0.0.2 is another address of this machine's loopback interface: a socket bound to every
# interface answers there, one bound to 127.0.0.1 does not. Nothing here leaves the machine.


# --- pickles ------------------------------------------------------------------------------------


def _victim_and_attacker(path: str) -> str:
    """Rank 1 sends a crafted pickle; rank 0 gathers objects the normal way."""
    if dist.get_rank() == 1:
        all_gather_object(_Exploit(path), allow_pickle=True)
        return "sent"
    try:
        all_gather_object({"metrics": [0.5]})
    except Exception as exc:  # the refusal is what this test wants to see
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_a_crafted_pickle_from_another_rank_is_rejected_not_executed(tmp_path: Path) -> None:
    path = str(tmp_path / "pwned")
    victim, attacker = run_parallel(_victim_and_attacker, path)
    assert attacker == "sent"
    assert victim.startswith("UnpicklingError"), victim
    assert "allow_pickle=True" in victim
    assert not Path(f"{path}.rank0").exists(), "the payload ran on the rank that did not allow pickles"
