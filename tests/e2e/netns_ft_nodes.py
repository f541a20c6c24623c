"""Two "nodes" of a fault-tolerant job, one replica group of two ranks each, in a network namespace of their own.

Run by tests/e2e/test_fault_tolerance.py as ``unshare -n python -m tests.e2e.netns_ft_nodes OUTDIR``: the
namespace has only its loopback, which carries the test addresses 10.77.0.1 (the lighthouse's host, named by
``--rdzv-endpoint``) and 10.77.0.2; no packet leaves it. Each node is one command, as a user types it on each
machine::

    ddpkit run --fault-tolerance --nnodes 2 -n 2 --rdzv-endpoint 10.77.0.1:29510 --secret-file SECRET \\
        --replica-id node-X --max-restarts 1 -m tests.e2e.ft_trainloop - - OUTDIR 30 DELAY

(``--replica-id``: both "nodes" have this machine's host name). Both ranks of ``node-b`` SIGKILL themselves in
step 30 (epoch 1), rank 1 of ``node-a`` in step 52 (epoch 2); each time the group's agent starts its ranks again.
Once both groups committed steps, this reads every socket the job's processes listen on; it then waits for both
commands to end and writes ``result.json`` in OUTDIR.

``python -m tests.e2e.netns_ft_nodes late OUTDIR``: both ranks of ``node-b`` SIGKILL themselves in step 60 of 69,
and their agent's restart comes only once ``node-a`` has finished (``$FT_LATE_RESTART``): a group started again
after the job finished, with nothing to tell it so but the quorums it no longer finds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ddpkit._trust.secret import write_secret_file
from tests.e2e.ft_trainloop import steps
from tests.helpers import descendants, holds_within, listening_sockets, namespace_loopback

HOST, OTHER = "10.77.0.1", "10.77.0.2"
DELAY_S = "0.35"
#: The step in which rank 1 of node-a kills itself (node-b's ranks: step 30).
SECOND_KILL_AT = 52


def main(out: Path, late: bool = False) -> None:
    namespace_loopback(HOST, OTHER)
    secret = out / "secret"
    write_secret_file(str(secret))
    marker = str(out / "restarted-{group}")
    waits = ",".join(marker.replace("{group}", group) for group in ("node-b", "node-a"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_KILL_GROUP": "node-b",
           "FT_KILL_ALSO": f"node-a:1:{SECOND_KILL_AT}", "FT_RESTART_MARKER": marker, "FT_WAIT_FOR": waits,
           "FT_WAIT_AT": f"34,{SECOND_KILL_AT + 4}"}  # fmt: skip
    kill_at = "30"
    if late:
        finished = ",".join(str(out / f"node-a{rank}.json") for rank in ("", ".rank1"))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "FT_KILL_GROUP": "node-b",
               "FT_LATE_RESTART": finished}  # fmt: skip
        kill_at = "60"
    env.pop("DDPKIT_JOB_SECRET", None)
    nodes: list[tuple[subprocess.Popen[bytes], Path]] = []
    result: dict[str, Any] = {}
    for name in ("node-a", "node-b"):  # node-a first: it serves the lighthouse (both could: one machine)
        command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "--nnodes", "2", "-n", "2",
                   "--rdzv-endpoint", f"{HOST}:29510", "--secret-file", str(secret), "--replica-id", name,
                   "--max-restarts", "1", "-m", "tests.e2e.ft_trainloop", "-", "-", str(out), kill_at,
                   DELAY_S]  # fmt: skip
        log = out / f"{name}.log"
        with open(log, "wb") as output:
            nodes.append((subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env), log))
        result[f"{name} said"] = holds_within(lambda log=log: "lighthouse at" in log.read_text(errors="replace"), 60)
    outs = [out / name for name in ("node-a", "node-a.rank1", "node-b", "node-b.rank1")]
    result["trained"] = holds_within(lambda: all(len(steps([o])) >= 5 for o in outs), 120)
    if result["trained"]:
        pids = [pid for node, _ in nodes for pid in descendants(node.pid)]
        result["listeners"] = sorted(set(listening_sockets(pids)))
    deadline = time.monotonic() + 240
    for node, _ in nodes:
        try:
            node.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()
    result["codes"] = [node.returncode for node, _ in nodes]
    result["logs"] = [log.read_text(errors="replace") for _, log in nodes]
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[-1]), sys.argv[1:-1] == ["late"])
