"""What several test modules share: fault tolerance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.builders import digits_loop


def _digits_loop(**kwargs: Any) -> Any:
    """The demo's model (unseeded) on the digits in batches of 16, in order, or on ``loader``; no validation."""
    from ddpkit.examples.demo import build_model

    return digits_loop(16, model=build_model(), shuffle=False, validation_batch_size=None, **kwargs)


def _survivors_wait_for_the_restart(tmp_path: Path) -> dict[str, str]:
    """The environment in which the groups that outlive step 30's kill wait, after step 34, until the restarted
    group has joined (tests/e2e/ft_trainloop.py): however slowly it starts, it finds peers to heal from."""
    marker = str(tmp_path / "restarted")
    return {"FT_RESTART_MARKER": marker, "FT_WAIT_FOR": marker, "FT_WAIT_AT": "34"}


#: Seconds from a kill to the survivors' next commit that tell "one step lost" from "a restart": 1.0-1.5 s on a
#: quiet 2-core machine (bench/fault_tolerance.py measures it), up to 3 s while another test loads the cores
#: (a quorum then splits: a group late by the lighthouse's 0.5 s join timeout); a restart takes 7-20 s.
NEXT_COMMIT_S = 4.0
