"""A fault-tolerant job started as users start it, and strangers to it, in a network namespace of its own.

Run by tests/e2e/test_quorum_proof.py as ``unshare -n python -m tests.e2e.netns_ft_job OUTDIR``: the namespace
has only its loopback, where the job's servers and the strangers meet (as other users of one machine would).
The job: ``ddpkit run --fault-tolerance -n 2 --max-restarts 2 -m tests.e2e.ft_trainloop - - OUTDIR 0 DELAY``
(a job secret drawn by ``ddpkit run``). Once both groups committed steps, this reads every socket the job's
processes listen on, then, one after another (each time waiting until both groups commit again):

0. ``kill``: the stranger reads the lighthouse's status page and posts ``/replica/<group-1's id>/kill``; this
   notes when that group's process died and when it committed a step again (started again by its agent);
1. ``join``: a torchft ``Manager`` of a stranger's own (tests/e2e/ft_stranger.py) takes part in the quorums for
   :data:`STRANGER_S` seconds, asking for the run's state and all-reducing 1e6 gradients;
2. ``claim``: another says it is at step 10**6 and serves a state with a pickled command;
3. ``secret``: a replica group of the same script (``group-x``), started by hand with another secret. The
   job's groups wait after step :data:`WAIT_AT` until group-x has joined or been refused (tests/e2e/ft_trainloop.py's
   ``FT_WAIT_FOR``), so that a slow start of it, or of the phases before, never finds the job finished.

It then waits for the job to end and writes ``result.json`` in OUTDIR.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.e2e.ft_trainloop import steps
from tests.helpers import OTHER_SECRET, descendants, holds_within, listening_sockets, namespace_loopback

#: Seconds each stranger takes part.
STRANGER_S = 10.0
#: Seconds each group waits after a committed step while the strangers take part (the job must outlast them).
DELAY_S = "1.5"
#: The step after which the job's groups wait for group-x (of 69; at DELAY_S each, past the phases before it).
WAIT_AT = 64
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONUNBUFFERED": "1"}
_ENV.pop("DDPKIT_JOB_SECRET", None)
#: What a group with another secret says of the job's record beside the lighthouse (its answers are signed with the
#: job's secret): it never joins a quorum.
_OTHER_SECRET = "(beside the lighthouse): its answer is not signed with this process's job secret: the lighthouse runs"


def _committed_since(out: Path, since: float, groups: tuple[str, ...] = ("group-0", "group-1")) -> bool:
    return all(any(r["t"] > since for r in steps([out / group])) for group in groups)


def _failed_steps(job_log: Path) -> int:
    """Steps not committed so far, as the groups' logs said (one line per group and step)."""
    return job_log.read_text().count("was not committed")


def _stranger(mode: str, lighthouse: str, out: Path) -> dict[str, Any]:
    target = out / mode
    failed_before = _failed_steps(out / "job.log")
    with open(f"{target}.log", "wb") as log:
        subprocess.run([sys.executable, "-m", "tests.e2e.ft_stranger", mode, lighthouse, str(target), str(STRANGER_S)],
                       stdout=log, stderr=subprocess.STDOUT, env=_ENV, timeout=120)  # fmt: skip
    report: dict[str, Any] = json.loads(Path(f"{target}.json").read_text())
    ended = report["ended"]
    report["went_on"] = holds_within(lambda: _committed_since(out, ended), 60)
    report["went_on_after"] = max(min(r["t"] for r in steps([out / group]) if r["t"] > ended)
                                  for group in ("group-0", "group-1")) - ended  # fmt: skip
    report["failed_steps_meanwhile"] = _failed_steps(out / "job.log") - failed_before
    return report


def _other_secret(lighthouse: str, out: Path) -> dict[str, Any]:
    log = out / "group-x.log"
    env = {**_ENV, "DDPKIT_JOB_SECRET": OTHER_SECRET, "FT_RESTARTED": "1",
           "FT_RESTART_MARKER": str(out / "group-x-joined")}  # fmt: skip
    command = [sys.executable, "-m", "tests.e2e.ft_trainloop", "group-x", lighthouse, str(out / "group-x"), "0", "0"]
    output = open(log, "wb")  # noqa: SIM115  # open while the group runs
    group = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    started = time.time()
    refused = holds_within(lambda: _OTHER_SECRET in log.read_text(), 60)
    Path(out / "group-x-joined").touch()  # it never joins: the job's groups need not wait for it
    time.sleep(2.0)
    os.killpg(group.pid, signal.SIGKILL)
    group.wait()
    stopped = time.time()
    return {
        "refused": refused,
        "log": log.read_text()[-6000:],
        "trained": len(steps([out / "group-x"])),
        "went_on": holds_within(lambda: _committed_since(out, stopped), 60),
        "seconds": time.time() - started,
    }


def _kill(lighthouse: str, out: Path) -> dict[str, Any]:
    """What the lighthouse's dashboard lets anyone do: kill a replica group by its id."""
    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    member = next(name for name in re.findall(r"<b>([^<]+)</b>", status) if name.startswith("group-1"))
    pid = max(r["pid"] for r in steps([out / "group-1"]))
    posted = time.time()
    request = urllib.request.Request(f"{lighthouse}/replica/{member}/kill", method="POST")
    try:
        urllib.request.urlopen(request, timeout=10).read()
    except Exception as exc:  # the killed manager may not answer
        answer = str(exc)
    else:
        answer = "ok"
    died = holds_within(lambda: not Path(f"/proc/{pid}").exists(), 30)
    died_after = time.time() - posted
    back = holds_within(lambda: any(r["t"] > posted and r["pid"] != pid for r in steps([out / "group-1"])), 90)
    return {"status_page_lists": re.findall(r"<b>([^<]+)</b>", status), "answer": answer, "died": died,
            "died_after": died_after, "back": back, "back_after": time.time() - posted}  # fmt: skip


def main(out: Path) -> None:
    namespace_loopback()
    result: dict[str, Any] = {}
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "2", "--max-restarts", "2",
               "-m", "tests.e2e.ft_trainloop", "-", "-", str(out), "0", DELAY_S]  # fmt: skip
    job_log = out / "job.log"
    output = open(job_log, "wb")  # noqa: SIM115  # open while the job runs
    env = {**_ENV, "FT_WAIT_FOR": str(out / "group-x-joined"), "FT_WAIT_AT": str(WAIT_AT),
           "FT_DELAY_UNTIL": str(out / "phases-done")}  # fmt: skip
    job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        found = holds_within(lambda: "lighthouse at http" in job_log.read_text(), 60)
        lighthouse = re.findall(r"lighthouse at (http://\S+)", job_log.read_text())[0] if found else ""
        result["lighthouse"] = lighthouse
        if holds_within(lambda: all(len(steps([out / g])) >= 3 for g in ("group-0", "group-1")), 120):
            result["listeners"] = listening_sockets(descendants(job.pid))
            result["kill"] = _kill(lighthouse, out)  # first: the killed group must be back before the job ends
            for mode in ("join", "claim"):
                result[mode] = _stranger(mode, lighthouse, out)
            result["marker"] = Path(f"{out / 'claim'}.marker").exists()
            result["secret"] = _other_secret(lighthouse, out)
        (out / "phases-done").touch()  # the rest of the job at full speed
        result["code"] = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        result["log"] = job_log.read_text()
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
