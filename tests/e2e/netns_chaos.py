"""The chaos suite across three "nodes", in a network namespace of its own.

Run by tests/e2e/test_chaos.py as ``unshare -n python -m tests.e2e.netns_chaos OUTDIR``: the namespace has only its
loopback, which carries the test address 10.77.0.1 (the lighthouse's host, named by ``--rdzv-endpoint``); no
packet leaves it. Each node is one command, as a user types it on each machine::

    ddpkit run --fault-tolerance --nnodes 3 -n 1 --rdzv-endpoint 10.77.0.1:29510 --secret-file SECRET \\
        --replica-id group-X --max-restarts 12 -m tests.e2e.chaos_job OUTDIR 6 0.1 OUTDIR/checkpoints-X

(each node its own checkpoint directory, as machines without a shared file system have). It fires seed
:data:`SEED`'s schedule (tests/support/chaos.py), checks the run and writes ``result.json`` in OUTDIR: the
figures, or ``failed`` with the reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.helpers import namespace_loopback
from tests.support.chaos import check_chaos, run_chaos, schedule

HOST = "10.77.0.1"
#: Its schedule: two groups killed together, a kill right after a comeback, a stall, a kill.
SEED = 2


def main(out: Path) -> None:
    namespace_loopback(HOST)
    run = run_chaos(SEED, out, endpoint=f"{HOST}:29510")
    result: dict[str, object] = {"schedule": [str(fault) for fault in schedule(SEED, 3, 138)]}
    try:
        result["figures"] = check_chaos(run)
    except AssertionError as error:
        result["failed"] = str(error)
    result["output"] = run.output[-6000:]
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[-1]))
