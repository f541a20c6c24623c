"""A two-node ``ddpkit run`` job, and a stranger who writes to its rendezvous store, in a network namespace.

Run by tests/test_security.py as ``unshare -n python -m tests.netns_job MODE OUTDIR``: the namespace
has only a loopback interface, which also carries the test address 10.77.0.1 (the rendezvous host);
no packet leaves it. Two agents (``is_host=true`` and ``is_host=false``) start one worker each; once
both workers run, this reads every socket the job's processes listen on, then the stranger acts:

* ``attack``: sets the rendezvous state to a pickle that would create a marker file;
* ``forged``: (the job has a secret) rewrites the signed state with one more node, keeping the old
  signature, as a stranger without the secret would have to;
* ``ipv6``: nobody acts; the rendezvous host is fd77::1 and the job is told to end.

It then waits for the agents to stop and writes ``result.json`` in OUTDIR.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.helpers import listening_sockets

HOST = "10.77.0.1"
HOST6 = "fd77::1"
RUN_ID = "job1"
KEY = f"torch.rendezvous.{RUN_ID}"
_WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
info = {key: os.environ[key] for key in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
info["pid"] = os.getpid()
with open(os.path.join(sys.argv[1], f"worker-{dist.get_rank()}.json"), "w") as out:
    json.dump(info, out)
for _ in range(600):  # until the driver says stop (every rank stops at the same step)
    flag = torch.tensor([float(os.path.exists(os.path.join(sys.argv[1], "stop")))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        break
    time.sleep(0.1)
"""


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def _store(port: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=10))


def _attack(port: int, out: Path) -> None:
    payload = pickle.dumps(_Exploit(str(out / "PWNED")))
    _store(port).set(KEY, base64.b64encode(payload).decode())


def _forge(port: int) -> dict[str, Any]:
    """Add a node to the signed state, keeping its signature (a stranger cannot make a new one)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    from ddpkit.jobs._rendezvous import _DIGEST, _SIGNED

    store = _store(port)
    stored = base64.b64decode(store.get(KEY))
    assert stored.startswith(_SIGNED), "the job's state is signed"
    head, state = stored[: len(_SIGNED) + _DIGEST], pickle.loads(stored[len(_SIGNED) + _DIGEST :])
    stranger = _NodeDesc(HOST, 4242, 0)
    state.participants[stranger] = len(state.participants)
    state.last_heartbeats[stranger] = max(state.last_heartbeats.values())
    store.set(KEY, base64.b64encode(head + pickle.dumps(state)).decode())
    return {"participants_before": len(state.participants) - 1}


def main(mode: str, out: Path) -> None:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{HOST}/32", "dev", "lo"], check=True)
    subprocess.run(["ip", "-6", "addr", "add", f"{HOST6}/128", "dev", "lo", "nodad"], check=True)
    script = out / "worker.py"
    script.write_text(_WORKER)
    host = HOST6 if mode == "ipv6" else HOST
    port = _free_port(host)
    endpoint = f"[{host}]:{port}" if mode == "ipv6" else f"{host}:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if mode == "forged":
        env["DDPKIT_JOB_SECRET"] = "a secret only the job's nodes have"
    agents = []
    for name, is_host in (("host", "true"), ("other", "false")):
        command = [
            sys.executable, "-m", "ddpkit", "run", "--nnodes", "2", "-n", "1",
            "--rdzv-endpoint", endpoint, "--rdzv-id", RUN_ID, "--rdzv-conf", f"is_host={is_host}",
            str(script), str(out),
        ]  # fmt: skip
        log = open(out / f"agent-{name}.log", "w")  # noqa: SIM115 - closed when the agents are done
        agents.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log))
        time.sleep(1)  # the host's agent binds first
    result: dict[str, Any] = {"rendezvous": [host, port]}
    try:
        result["started"] = _wait_for(lambda: len(list(out.glob("worker-*.json"))) == 2, 90)
        workers = [json.loads(path.read_text()) for path in sorted(out.glob("worker-*.json"))]
        result["workers"] = workers
        result["listeners"] = {
            "agents": [listening_sockets([agent.pid]) for agent, _ in agents],
            "workers": [listening_sockets([int(worker["pid"])]) for worker in workers],
        }
        if result["started"]:
            if mode == "attack":
                _attack(port, out)
            elif mode == "forged":
                result.update(_forge(port))
            else:
                (out / "stop").touch()
        acted = time.monotonic()
        result["stopped"] = _wait_for(lambda: all(agent.poll() is not None for agent, _ in agents), 60)
        result["seconds_to_stop"] = round(time.monotonic() - acted, 1)
    finally:
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait()
            log.close()
    result["exit_codes"] = [agent.returncode for agent, _ in agents]
    result["logs"] = [(out / f"agent-{name}.log").read_text() for name in ("host", "other")]
    result["marker"] = (out / "PWNED").exists()
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
