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


def check_group_1_lost_rank_1_and_healed(done: Any, out: Path) -> tuple[list[Path], list[Path]]:
    """`ddpkit run --fault-tolerance -n 4 --group-size 2 --max-restarts 1` (``done``: its finished process, logs in
    ``out``, tests/e2e/ft_trainloop.py) in which rank 1 of group-1 killed itself in step 30: the job ended with
    status 0, group-1's agent restarted both its ranks, which came back behind the kill and trained again with
    group-0; group-0 kept its processes and committed within NEXT_COMMIT_S. The logs of group-0's ranks and of
    group-1's."""
    import re

    from tests.e2e.ft_trainloop import records, steps

    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddpkit: replica group group-1: restart 1 of 1: local rank 1 was killed by signal SIGKILL" in done.stderr, (
        done.stderr[-3000:]
    )
    named = r"replica group group-0 at step \d+: (.*; )?group-1 (left the quorum|came back as a new process)"
    assert re.search(named, done.stderr), done.stderr[-3000:]
    survivors = [out / "group-0", out / "group-0.rank1"]
    restarted = [out / "group-1", out / "group-1.rank1"]
    killed = next(r["kill"] for r in records(restarted[1]) if "kill" in r)
    for log in survivors:
        committed = steps([log])
        assert len({r["pid"] for r in committed}) == 1, f"{log.name} was restarted"
        after = next(r for r in committed if r["t"] > killed)["t"] - killed
        print(f"{log.name} committed its next step {after:.2f} s after the kill")
        assert after < NEXT_COMMIT_S, f"next commit {after:.2f} s after the kill: {done.stderr[-4000:]}"
    for log in restarted:
        assert len({r["pid"] for r in steps([log])}) == 2, f"{log.name} was not started again"
        back = [r for r in steps([log]) if r["t"] > killed]
        assert back[0]["step"] >= 30, f"{log.name} started over instead of taking its peers' state"
        assert any(r["groups"] == 2 and r["items"] for r in back), f"{log.name} never trained again"
    return survivors, restarted
