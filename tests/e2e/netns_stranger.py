"""A ``ddpkit run -n 2 --secret-file`` job and a stranger who reaches its process-group store, in a network
namespace of their own.

Run by tests/e2e/test_stranger.py as ``unshare -n python -m tests.e2e.netns_stranger MODE OUTDIR``: the
namespace has only its loopback; no packet leaves it. The job's script makes its group with ddpkit
(``ensure_dist_connection``, as ``TrainLoop.fit`` does: mode ``ddpkit``) or with a plain
``init_process_group`` (mode ``plain``), writes where its store is, and all-reduces a flag every 0.1 s. The
stranger, a program with torch's own ``TCPStore`` that knows only that address:

1. lists the store's keys, writes the hang watchdog's trigger under the key the job's watchdog reads (found from
   gloo's keys), and writes it again every 0.2 s for 3 s: the ranks must go on;
2. then rank 1 stops for good before the next all-reduce (a real hang): while the watchdogs report it, the
   stranger reads every value in the store, to find what the ranks told each other (host name, pids, stacks).

It writes ``result.json`` in OUTDIR: the job's exit status and output, which ranks got past the stranger's
trigger, and what the stranger read.

Mode ``relay``: the stranger controls the network (as a switch or a router on the path would): every TCP
connection between the job's processes (127.0.0.1 to 127.0.0.1) is redirected (iptables' DNAT) to a relay on
127.0.0.2, which connects to where the connection was going (``SO_ORIGINAL_DST``) and passes the bytes on both
ways: the stores, the rendezvous, gloo. Nothing in any store is changed. The job (``ensure_dist_connection``,
then an all-reduce) must stop before its all-reduce, naming 127.0.0.2.

Mode ``ft``: ``ddpkit run --fault-tolerance -n 2 --secret-file`` (two replica groups of a digits ``TrainLoop``,
tests/e2e/ft_trainloop.py) and, once both committed 3 steps, two strangers one after the other, each for
:data:`ATTACK_S` seconds:

1. *store*: it reads group-0's replica id (``NAME:uuid``) on the lighthouse's status page and asks the
   lighthouse for quorums in group-0's name, giving a store of its own (on 127.0.0.2) and step 10**6, so that the
   quorums name its store: what the groups write there (their signed gloo addresses, before) is what it could
   replay in a later job or use to relay;
2. *relay*: every new connection between the job's processes to a port nobody listened on when it began goes
   through a relay on 127.0.0.2 (DNAT); the stranger of 1. speaks once more, so that the quorum changes and the
   next quorums' gloo groups, made anew, connect through the relay.

The job must go on when each leaves and end with one process's weights; nothing may reach the stranger's store.

Mode ``replay``: two jobs one after the other with the same secret, as an ``srun``/``mpirun`` task pair would
start them (``init_dist_connection`` with a fixed ``MASTER_PORT``, the secret in ``DDPKIT_JOB_SECRET``): the same
store address, run id and attempt. The stranger records every value in job 1's store while it runs, then writes
them all back into job 2's store, again and again, from the moment it answers (job 2's rank 1 comes 3 s late).
Job 2 must refuse them before any tensor moves, naming the address they point to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpkit._trust.secret import write_secret_file
from tests.helpers import job_environment, namespace_loopback

#: The watchdog's deadline (seconds): the real hang is reported this long after it starts.
DEADLINE = 4
_SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
out = sys.argv[1]
if sys.argv[2] == "ddpkit":
    from ddpkit import ensure_dist_connection
    ensure_dist_connection()
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
open(os.path.join(out, f"pid-{os.getpid()}"), "w").close()
if rank == 0:
    with open(os.path.join(out, "store.json"), "w") as handle:
        json.dump([os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])], handle)
for _ in range(600):  # until the stranger is done with its trigger (every rank stops at the same step)
    flag = torch.tensor([float(os.path.exists(os.path.join(out, "hang")))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        break
    time.sleep(0.1)
open(os.path.join(out, f"survived-{rank}"), "w").close()
if rank == 1:
    time.sleep(120)  # rank 1 stops: a real hang
dist.all_reduce(torch.ones(3))
"""


_RELAYED_SCRIPT = """
import sys, torch, torch.distributed as dist
from ddpkit import ensure_dist_connection
ensure_dist_connection()
value = torch.tensor([2.0])
dist.all_reduce(value)
print("all_reduce returned", value.item(), flush=True)
"""
RELAY = "127.0.0.2"
RELAY_PORT = 7777
#: Seconds each stranger of mode ``ft`` takes part.
ATTACK_S = 8.0
#: Seconds an aborted quorum group is held after its abort (ft_trainloop's TorchFT timeout 5 s + 5), and a margin.
GROUP_HELD_S = 11.0


def main(mode: str, out: Path) -> None:
    namespace_loopback()
    if mode == "relay":
        relayed(out)
        return
    if mode == "ft":
        fault_tolerant(out)
        return
    if mode == "replay":
        replayed(out)
        return
    secret = out / "secret"
    write_secret_file(str(secret))
    script = out / "job.py"
    script.write_text(_SCRIPT)
    env = job_environment("TORCH")
    env.update(PYTHONUNBUFFERED="1", DDPKIT_HANG_REPORT_DIR=str(out))
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", "--secret-file", str(secret), "--timeout",
               str(DEADLINE), str(script), str(out), mode]  # fmt: skip
    result: dict[str, Any] = {}
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as job:
        try:
            result.update(_stranger(out))
            output, _ = job.communicate(timeout=120)
        finally:
            job.kill()
    result["exit_code"] = job.returncode
    result["output"] = output.decode(errors="replace")
    result["survived"] = sorted(path.name for path in out.glob("survived-*"))
    result["host"] = socket.gethostname()
    result["pids"] = sorted(int(path.name.split("-")[1]) for path in out.glob("pid-*"))
    (out / "result.json").write_text(json.dumps(result))


def _stranger(out: Path) -> dict[str, Any]:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    found: dict[str, Any] = {"trigger_key": None, "values": {}}
    path = out / "store.json"
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    host, port = json.loads(path.read_text())
    store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    gloo = [key for key in store.list_keys() if re.search(r"/cpu//0/\d+$", key)]
    found["keys"] = store.list_keys()
    prefix = re.sub(r"/cpu//0/\d+$", "", gloo[0])
    trigger = f"{prefix}/ddpkit/hang/trigger"
    found["trigger_key"] = trigger
    until = time.monotonic() + 3.0
    while time.monotonic() < until:  # step 1: the trigger, again and again
        store.set(trigger, b"1")
        time.sleep(0.2)
    (out / "hang").touch()
    until = time.monotonic() + 3 * DEADLINE + 10
    while time.monotonic() < until:  # step 2: whatever the ranks tell each other
        try:
            for key in store.list_keys():
                if "ddpkit/hang/" in key and key != trigger:
                    found["values"][key] = bytes(store.get(key)).hex()
        except Exception:  # the store went with rank 0
            break
        time.sleep(0.1)
    return found


def relayed(out: Path) -> None:
    """Mode ``relay`` (see the module's docstring)."""
    import threading

    secret = out / "secret"
    write_secret_file(str(secret))
    script = out / "job.py"
    script.write_text(_RELAYED_SCRIPT)
    listener = socket.socket()
    listener.bind((RELAY, RELAY_PORT))
    listener.listen(64)
    relayed: list[str] = []
    threading.Thread(target=_relay, args=(listener, relayed), daemon=True).start()
    subprocess.run(["iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-s", "127.0.0.1", "-d", "127.0.0.1",
                    "-j", "DNAT", "--to-destination", f"{RELAY}:{RELAY_PORT}"], check=True)  # fmt: skip
    env = job_environment("TORCH")
    env.update(PYTHONUNBUFFERED="1", DDPKIT_PROOF_TIMEOUT="10")
    command = [sys.executable, "-m", "ddpkit", "run", "-n", "2", "--secret-file", str(secret), str(script)]
    started = time.monotonic()
    job = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=150)
    result = {"exit_code": job.returncode, "output": job.stdout.decode(errors="replace"),
              "seconds": time.monotonic() - started, "relayed": relayed}  # fmt: skip
    (out / "result.json").write_text(json.dumps(result))


def _relay(listener: socket.socket, relayed: list[str]) -> None:
    """Accept what the network sends here, connect from the relay's address to where it was going, and pass the
    bytes on both ways (each connection in threads of its own)."""
    import struct
    import threading

    def pipe(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def serve(client: socket.socket) -> None:
        try:
            original = client.getsockopt(socket.SOL_IP, 80, 16)  # SO_ORIGINAL_DST: where it was going
            port, host = struct.unpack_from("!H", original, 2)[0], socket.inet_ntoa(original[4:8])
            upstream = socket.socket()
            upstream.bind((RELAY, 0))
            upstream.connect((host, port))
        except OSError as exc:
            relayed.append(f"failed: {exc}")
            client.close()
            return
        relayed.append(f"{host}:{port} at {time.time()!r}")
        threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
        pipe(upstream, client)

    while True:
        client, _ = listener.accept()
        threading.Thread(target=serve, args=(client,), daemon=True).start()


def fault_tolerant(out: Path) -> None:
    """Mode ``ft`` (see the module's docstring)."""
    import signal
    import threading

    from tests.e2e.ft_trainloop import steps
    from tests.helpers import descendants, listening_sockets

    secret = out / "secret"
    write_secret_file(str(secret))
    listener = socket.socket()
    listener.bind((RELAY, RELAY_PORT))
    listener.listen(64)
    relayed: list[str] = []
    threading.Thread(target=_relay, args=(listener, relayed), daemon=True).start()
    # A rule that does nothing, from the start: the kernel then tracks every connection of the job with its
    # (absent) translation, so that the relay's rule, added later, takes only the connections made after it.
    subprocess.run(["iptables", "-t", "nat", "-A", "OUTPUT", "-d", "127.0.0.3", "-j", "ACCEPT"], check=True)
    env = job_environment("TORCH")
    env.update(OMP_NUM_THREADS="1", RUST_LOG="warn", PYTHONUNBUFFERED="1", FT_DELAY_UNTIL=str(out / "phases-done"))
    command = [sys.executable, "-m", "ddpkit", "run", "--fault-tolerance", "-n", "2", "--secret-file", str(secret),
               "-m", "tests.e2e.ft_trainloop", "-", "-", str(out), "0", "0.4"]  # fmt: skip
    log = out / "job.log"
    result: dict[str, Any] = {}
    groups = [out / "group-0", out / "group-1"]
    with open(log, "wb") as output:
        job = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not all(len(steps([group])) >= 3 for group in groups) and time.monotonic() < deadline:
                time.sleep(0.2)
            lighthouse = re.findall(r"lighthouse at (http://\S+)", log.read_text())[0]
            before = set(listening_sockets(descendants(job.pid)))
            phase = time.monotonic()
            result["store"] = _speak_for_group_0(lighthouse, groups)
            # The servers (stores, lighthouse, managers) are left alone: the ports that listened before and after the
            # store's stranger, whose quorums made the groups' gloo groups anew (a port of an earlier gloo group,
            # closed since, may be a new gloo group's: a rule for it would let that group's connections pass by).
            # The group aborted at the phase's first quorum is held (and listens) for the quorum's timeout + 5 s
            # (fault_tolerance/_waits.reap) after it: "after" is read once it has let go, so that its port, free
            # again later, is no rule's. The relay takes the new connections of the next quorums' gloo groups.
            time.sleep(max(0.0, phase + GROUP_HELD_S - time.monotonic()))
            servers = before & set(listening_sockets(descendants(job.pid)))
            result["servers"] = sorted(port for _, port in servers)
            rules = [["OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-j", "RETURN"]
                     for _, port in sorted(servers)]  # fmt: skip
            rules.append(["OUTPUT", "-p", "tcp", "-s", "127.0.0.1", "-d", "127.0.0.1", "-j", "DNAT",
                          "--to-destination", f"{RELAY}:{RELAY_PORT}"])  # fmt: skip
            for rule in rules:
                subprocess.run(["iptables", "-t", "nat", "-A", *rule], check=True)
            started = time.time()
            # A quorum that changes: the groups' gloo group is made anew, its connections through the relay.
            _speak_for_group_0(lighthouse, groups, 1.0, wait=False)
            released = _relay_for(ATTACK_S, started, relayed, servers, job.pid)
            # The relay is on until its rule goes: the time before that rule's removal begins is when it ended (the
            # kernel drops the rule before iptables returns, 0.3 s later on a loaded machine, so a step may commit
            # without the relay before a time taken after the removal).
            ended = time.time()
            for rule in reversed(rules):  # the relay's rule first
                subprocess.run(["iptables", "-t", "nat", "-D", *rule], check=False)  # gone already if released
            for _, holder in released:
                holder.close()
            result["released"] = [port for port, _ in released]
            # From the first connection through the relay (a quorum's new gloo group) until it stops, no step of
            # both groups may commit (one second for a step that was committing as the quorum changed). A group
            # that the lighthouse left alone in a quorum (the other's heartbeats late on a loaded machine) commits
            # without any connection to the other: counted apart, it is no step through the relay.
            times = [float(entry.rpartition(" at ")[2]) for entry in relayed if " at " in entry]
            first = min(times, default=ended)
            meanwhile = [r["groups"] for r in steps(groups) if first + 1.0 < r["t"] < ended]
            result["relay"] = {"relayed": list(relayed), "committed_meanwhile": sum(g != 1 for g in meanwhile),
                               "alone_meanwhile": sum(g == 1 for g in meanwhile),
                               "relaying_s": ended - first, "went_on": _went_on(groups, ended)}  # fmt: skip
            (out / "phases-done").touch()  # the rest of the job at full speed
            result["code"] = job.wait(timeout=240)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    result["log"] = log.read_text()
    (out / "result.json").write_text(json.dumps(result))


def _relay_for(
    seconds: float, started: float, relayed: list[str], servers: set[tuple[str, int]], job: int
) -> list[tuple[int, socket.socket]]:
    """Keep the relay on until ``seconds`` after both ``started`` and its first connection (45 s at most).

    A server's port that stops listening meanwhile was no server's (an aborted gloo group that the reaper still
    held): the test binds that port itself, so that no later gloo group of the job gets it, and only then drops
    its RETURN rule. Returns those ports with the sockets that hold them (the caller closes them)."""
    from tests.helpers import descendants, listening_sockets

    released: list[tuple[int, socket.socket]] = []
    ruled = {port for _, port in servers}
    while True:
        now = time.time()
        first = min((float(e.rpartition(" at ")[2]) for e in relayed if " at " in e), default=now)
        if now >= max(started, first) + seconds or now >= started + 45:
            return released
        listening = {port for _, port in listening_sockets(descendants(job))}
        for port in sorted(ruled - listening):
            holder = socket.socket()
            with contextlib.suppress(OSError):  # taken at once by another socket of the job: the rule stays
                holder.bind(("127.0.0.1", port))
                ruled.discard(port)
                released.append((port, holder))
                rule = ["OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-j", "RETURN"]
                subprocess.run(["iptables", "-t", "nat", "-D", *rule], check=True)
        time.sleep(0.05)


def _went_on(groups: list[Path], since: float) -> float | None:
    """Seconds after ``since`` until both groups committed a step again (``None``: not within 60 s)."""
    from tests.e2e.ft_trainloop import steps

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        after = [[r["t"] for r in steps([group]) if r["t"] > since] for group in groups]
        if all(after):
            return max(min(times) for times in after) - since
        time.sleep(0.2)
    return None


def _speak_for_group_0(
    lighthouse: str, groups: list[Path], seconds: float = ATTACK_S, *, wait: bool = True
) -> dict[str, Any]:
    """Ask the lighthouse for quorums in group-0's name, with a store of the stranger's own, for ``seconds``; with
    ``wait``, then wait until both groups committed again (``went_on``)."""
    import urllib.request

    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from torchft._torchft import LighthouseClient

    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    member = next(name for name in re.findall(r"<b>([^<]+)</b>", status) if name.startswith("group-0:"))
    store = TCPStore(RELAY, 0, is_master=True, wait_for_workers=False)
    client = LighthouseClient(lighthouse, timedelta(seconds=5))
    asked, errors = 0, []
    started = time.time()
    while time.time() < started + seconds:
        try:
            client.quorum(replica_id=member, timeout=timedelta(seconds=2), address=f"http://{RELAY}:1",
                          store_address=f"{RELAY}:{store.port}", step=10**6, world_size=1,
                          shrink_only=False)  # fmt: skip
            asked += 1
        except Exception as exc:  # a quorum that did not form in time: ask again
            errors.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    ended = time.time()
    return {"member": member, "asked": asked, "errors": errors[-3:], "keys": store.list_keys(),
            "went_on": _went_on(groups, ended) if wait else None}  # fmt: skip


_TASK = """
import os, sys, time, torch, torch.distributed as dist
from ddpkit import GroupProofError, init_dist_connection
from ddpkit.environments import LocalEnvironment
rank = int(sys.argv[1])
if rank == 1 and os.environ.get("LATE"):
    time.sleep(3)  # the stranger is faster
try:
    init_dist_connection(LocalEnvironment(), "gloo", global_rank=rank, world_size=2)
except GroupProofError as exc:
    print(f"rank {rank} refused: {exc}", flush=True)
    raise SystemExit(1)
value = torch.tensor([2.0])
dist.all_reduce(value)
print(f"rank {rank}: all_reduce returned {value.item()}", flush=True)
if os.environ.get("LINGER"):  # job 1: until the stranger has read the store
    open(os.path.join(os.environ["LINGER"], f"reduced.{rank}"), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(os.environ["LINGER"], "recorded")) and time.monotonic() < deadline:
        time.sleep(0.05)
dist.barrier()
"""
REPLAY_PORT = 29555


def replayed(out: Path) -> None:
    """Mode ``replay`` (see the module's docstring)."""
    import secrets
    import threading

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    script = out / "task.py"
    script.write_text(_TASK)
    env = job_environment("TORCH")
    env.update(PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(REPLAY_PORT), GLOO_SOCKET_IFNAME="lo",
               DDPKIT_JOB_SECRET=secrets.token_hex(32), DDPKIT_PROOF_TIMEOUT="5", DDPKIT_HANG_TIMEOUT="0")  # fmt: skip

    def run(extra: dict[str, str], during: Any) -> list[str]:
        tasks = [subprocess.Popen([sys.executable, str(script), str(rank)], env={**env, **extra},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]  # fmt: skip
        during()
        outputs = []
        for task in tasks:
            try:
                outputs.append(task.communicate(timeout=60)[0].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                task.kill()
                outputs.append(task.communicate()[0].decode(errors="replace") + "\n(killed after 60 s)")
        return outputs

    def connect() -> Any:
        """A client of the job's store as soon as it listens: a plain socket polls the port first (torch's client
        backs off for seconds between attempts to a port nobody listens on yet, and the stranger must be
        faster than the job's late rank)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", REPLAY_PORT), timeout=1).close()
                return TCPStore("127.0.0.1", REPLAY_PORT, is_master=False, timeout=timedelta(seconds=5))
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.005)

    recorded: dict[str, bytes] = {}

    def record() -> None:
        store = connect()
        deadline = time.monotonic() + 60
        while not all((out / f"reduced.{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the group is made and has all-reduced (the job waits for the file below)
        recorded.update({key: bytes(store.get(key)) for key in store.list_keys()})
        (out / "recorded").touch()

    first = run({"LINGER": str(out)}, record)
    stop = threading.Event()

    def replay() -> None:
        store = connect()
        while not stop.is_set():
            for key, value in recorded.items():
                with contextlib.suppress(Exception):
                    store.set(key, value)
            time.sleep(0.01)

    replaying = threading.Thread(target=replay, daemon=True)
    second = run({"LATE": "1"}, replaying.start)
    stop.set()
    result = {"first": first, "second": second, "recorded": sorted(recorded)}
    (out / "result.json").write_text(json.dumps(result))
    replaying.join(30)  # not in torch's store client at the interpreter's exit (that aborts the process)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
