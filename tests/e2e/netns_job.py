"""A two-node ``ddpkit run`` job, and a stranger who writes to its rendezvous store, in a network namespace.

Run by tests/e2e/test_security.py as ``unshare -n python -m tests.e2e.netns_job MODE OUTDIR``: the namespace
has only a loopback interface, which also carries the test address 10.77.0.1 (the rendezvous host);
no packet leaves it. Two agents (``is_host=true`` and ``is_host=false``) start one worker each; once
both workers run, this reads every socket the job's processes listen on, then the stranger acts:

* ``attack``: sets the rendezvous state to a pickle that would create a marker file;
* ``forged``: (the job has a secret) rewrites the signed state with one more node, keeping the old
  signature, as a stranger without the secret would have to;
* ``ipv6``: nobody acts; the rendezvous host is fd77::1 and the job is told to end.
* ``hijack``: (the job has a secret) from before the agents start, the stranger keeps writing the rounds'
  ``MASTER_ADDR``, ``MASTER_PORT`` and assigned ranks, pointing at a store and a gloo group of its own on
  10.77.0.2, where it waits as rank 0 to all-reduce with whichever worker comes;
* ``takeover``: (the job has a secret; its workers make their group with ddpkit, rank 1 late) the stranger
  reads the job's real ``MASTER_ADDR``/``MASTER_PORT`` and tries to take rank 1 of the default group from
  10.77.0.2 with torch's own classes before the real rank 1 comes (its gloo address under rank 1's key),
  then all-reduces.

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

from tests.helpers import JOB_SECRET, free_port, holds_within, listening_sockets, namespace_loopback

HOST = "10.77.0.1"
HOST6 = "fd77::1"
#: The stranger's address, on the same loopback.
STRANGER = "10.77.0.2"
RUN_ID = "job1"
KEY = f"torch.rendezvous.{RUN_ID}"
_WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
info = {key: os.environ[key] for key in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
info["pid"] = os.getpid()
path = os.path.join(sys.argv[1], f"worker-{dist.get_rank()}.json")
with open(path + ".tmp", "w") as out:  # renamed when written: the driver reads it as soon as it is there
    json.dump(info, out)
os.replace(path + ".tmp", path)
for _ in range(600):  # until the driver says stop (every rank stops at the same step)
    flag = torch.tensor([float(os.path.exists(os.path.join(sys.argv[1], "stop")))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        break
    time.sleep(0.1)
"""


#: A worker that makes its group with ddpkit (the proof runs); rank 1 comes late.
_DDPKIT_WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
from ddpkit import ensure_dist_connection
if os.environ["RANK"] == "1":
    time.sleep(8)  # the stranger is faster
try:
    ensure_dist_connection()
except Exception as exc:
    with open(os.path.join(sys.argv[1], f"refusal-{os.environ['RANK']}.txt"), "w") as out:
        out.write(f"{type(exc).__name__}: {exc}")
    raise
value = torch.tensor([2.0])
dist.all_reduce(value)
path = os.path.join(sys.argv[1], f"worker-{dist.get_rank()}.json")
with open(path + ".tmp", "w") as out:  # renamed when written: the driver reads it as soon as it is there
    json.dump({"sum": value.item()}, out)
os.replace(path + ".tmp", path)
"""

#: The stranger's side of ``hijack`` and ``takeover``: torch's own store and gloo, as any program could use them.
_STRANGER_GROUP = """
import json, sys, torch, torch.distributed as dist
from datetime import timedelta
out, rank, store_host, store_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
raw = dist.TCPStore(store_host, store_port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
options = dist.ProcessGroupGloo._Options()
options._devices = [dist.ProcessGroupGloo.create_device(hostname="10.77.0.2")]
options._timeout = timedelta(seconds=120)
def report(**what):
    with open(f"{out}/stranger.json", "w") as handle:
        json.dump(what, handle)
report(joined=False)
group = dist.ProcessGroupGloo(dist.PrefixStore("default_pg/0//cpu/", raw), rank, 2, options)
report(joined=True)
value = torch.tensor([1000.0])
try:
    group.allreduce([value]).wait()
    report(joined=True, all_reduce=value.item())
except Exception as exc:
    report(joined=True, error=str(exc).splitlines()[0])
"""


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _store(port: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=10))


def _attack(port: int, out: Path) -> None:
    payload = pickle.dumps(_Exploit(str(out / "PWNED")))
    _store(port).set(KEY, base64.b64encode(payload).decode())


def _forge(port: int) -> dict[str, Any]:
    """Add a node to the signed state, keeping its signature (a stranger cannot make a new one)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    from ddpkit._trust.secret import SIGNED_HEADER_BYTES, SIGNED_MARK

    store = _store(port)
    stored = base64.b64decode(store.get(KEY))
    assert stored.startswith(SIGNED_MARK), "the job's state is signed"
    at = SIGNED_HEADER_BYTES + 8  # mark, version, signature, counter
    head, state = stored[:at], pickle.loads(stored[at:])
    stranger = _NodeDesc(HOST, 4242, 0)
    state.participants[stranger] = len(state.participants)
    state.last_heartbeats[stranger] = max(state.last_heartbeats.values())
    store.set(KEY, base64.b64encode(head + pickle.dumps(state)).decode())
    return {"participants_before": len(state.participants) - 1}


def _stranger_group(out: Path, rank: int, store_host: str, store_port: int) -> subprocess.Popen[bytes]:
    script = out / "stranger.py"
    script.write_text(_STRANGER_GROUP)
    log = open(out / "stranger.log", "w")  # noqa: SIM115 - the child keeps it
    command = [sys.executable, str(script), str(out), str(rank), store_host, str(store_port)]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def _keep_hijacking(port: int, stranger_port: int, stop: Any) -> None:
    """Write the first rounds' MASTER_ADDR/MASTER_PORT and assigned ranks, again and again, until ``stop()``."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = None
    while not stop():
        if store is None and not _listening(HOST, port):  # TCPStore's own retries back off for seconds
            time.sleep(0.005)
            continue
        try:
            store = store or TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=2))
            for round_ in range(4):
                prefix = f"{KEY}.{round_}/"
                store.set(prefix + "MASTER_ADDR", STRANGER)
                store.set(prefix + "MASTER_PORT", str(stranger_port))
                for node in range(2):
                    store.set(f"{prefix}torchelastic/assigned_ranks/{node}", json.dumps([node, 2, node, 2]))
        except Exception:  # the store is not up yet, or is gone
            store = None
        time.sleep(0.02)


def _real_master(port: int) -> tuple[str, int]:
    """The job's MASTER_ADDR and MASTER_PORT, read from the rendezvous store (signed, not secret)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from ddpkit._trust.secret import SIGNED_HEADER_BYTES

    store = TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=60))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for round_ in range(4):
            key, port_key = f"{KEY}.{round_}/MASTER_ADDR", f"{KEY}.{round_}/MASTER_PORT"
            if store.check([key, port_key]):
                at = SIGNED_HEADER_BYTES
                return bytes(store.get(key))[at:].decode(), int(bytes(store.get(port_key))[at:])
        time.sleep(0.05)
    raise RuntimeError("no MASTER_ADDR in the rendezvous store")


def _start_agents(endpoint: str, script: Path, out: Path, env: dict[str, str]) -> list[tuple[Any, Any]]:
    """The job's two agents (``is_host=true`` first, which binds the store), each logging to ``agent-NAME.log``."""
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
    return agents


def main(mode: str, out: Path) -> None:
    namespace_loopback(HOST, STRANGER)
    subprocess.run(["ip", "-6", "addr", "add", f"{HOST6}/128", "dev", "lo", "nodad"], check=True)
    if mode in ("hijack", "takeover"):
        _secret_job(mode, out)
        return
    script = out / "worker.py"
    script.write_text(_WORKER)
    host = HOST6 if mode == "ipv6" else HOST
    port = free_port(host)
    endpoint = f"[{host}]:{port}" if mode == "ipv6" else f"{host}:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if mode == "forged":
        env["DDPKIT_JOB_SECRET"] = JOB_SECRET
    agents = _start_agents(endpoint, script, out, env)
    result: dict[str, Any] = {"rendezvous": [host, port]}
    try:
        result["started"] = holds_within(lambda: len(list(out.glob("worker-*.json"))) == 2, 90)
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
        result["stopped"] = holds_within(lambda: all(agent.poll() is not None for agent, _ in agents), 60)
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


def _secret_job(mode: str, out: Path) -> None:
    """``hijack`` and ``takeover``: a two-node job with a secret, and the stranger's group (see the module)."""
    import threading

    script = out / "worker.py"
    script.write_text(_DDPKIT_WORKER)
    port = free_port(HOST)
    endpoint = f"{HOST}:{port}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", DDPKIT_JOB_SECRET=JOB_SECRET)
    env["DDPKIT_PROOF_TIMEOUT"] = "10"
    result: dict[str, Any] = {"rendezvous": [HOST, port]}
    done = threading.Event()
    stranger = None
    hijacker = threading.Thread(target=lambda: None)
    if mode == "hijack":
        stranger_port = free_port(STRANGER)
        stranger = _stranger_group(out, 0, STRANGER, stranger_port)
        hijacker = threading.Thread(target=_keep_hijacking, args=(port, stranger_port, done.is_set), daemon=True)
    hijacker.start()
    started = time.monotonic()
    agents = _start_agents(endpoint, script, out, env)
    try:
        if mode == "takeover":
            master = _real_master(port)
            result["master"] = list(master)
            stranger = _stranger_group(out, 1, *master)
        result["stopped"] = holds_within(lambda: all(agent.poll() is not None for agent, _ in agents), 120)
        result["seconds"] = round(time.monotonic() - started, 1)
    finally:
        done.set()
        hijacker.join(timeout=10)
        for agent, log in agents:
            if agent.poll() is None:
                agent.kill()
            agent.wait()
            log.close()
        if stranger is not None:
            time.sleep(2)  # its all-reduce fails once the job's processes are gone, or never ends
            stranger.kill()
            stranger.wait()
    result["exit_codes"] = [agent.returncode for agent, _ in agents]
    result["logs"] = [(out / f"agent-{name}.log").read_text() for name in ("host", "other")]
    result["stranger"] = json.loads((out / "stranger.json").read_text()) if (out / "stranger.json").exists() else {}
    result["sums"] = [json.loads(path.read_text())["sum"] for path in sorted(out.glob("worker-*.json"))]
    result["refusals"] = {path.stem: path.read_text() for path in sorted(out.glob("refusal-*.txt"))}
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
