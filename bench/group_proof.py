"""What the group proof costs: making the default group with a job secret (every rank proves it) against without.

    .venv/bin/python bench/group_proof.py [--reps 20] [--nprocs 2]

Spawns ``--nprocs`` CPU ranks once; each then makes and destroys the default
group ``--reps`` times with ``init_dist_connection`` (gloo on loopback, a new
port each time), with and without ``DDPKIT_JOB_SECRET``, alternating. Reported
(rank 0's wall time per ``init_dist_connection``): medians of both, their
difference (the group's id agreed in its store, its addresses signed, and the
proof: two all-gathers of a nonce, a tag and each rank's view of its
connections) and the ratio. A job pays it once, when its group is made.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import statistics
import time

import torch.multiprocessing as mp


def _free_ports(count: int) -> list[int]:
    ports = []
    for _ in range(count):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    return ports


def _rank(rank: int, nprocs: int, ports: list[int], secret: str, results: dict[str, list[float]]) -> None:
    import torch

    from ddpkit import destroy_dist_connection, init_dist_connection
    from ddpkit.environments import LocalEnvironment

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", DDPKIT_HANG_TIMEOUT="0")
    for index, port in enumerate(ports):
        kind = "secret" if index % 2 else "plain"
        os.environ["MASTER_PORT"] = str(port)
        if kind == "secret":
            os.environ["DDPKIT_JOB_SECRET"] = secret
        else:
            os.environ.pop("DDPKIT_JOB_SECRET", None)
        started = time.perf_counter()
        init_dist_connection(LocalEnvironment(), "gloo", global_rank=rank, world_size=nprocs)
        elapsed = time.perf_counter() - started
        destroy_dist_connection()
        if rank == 0:
            results.setdefault(kind, []).append(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    ports = _free_ports(2 * args.reps)
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_collect, (args.nprocs, ports, secrets.token_hex(32), shared), nprocs=args.nprocs)
        results = {kind: list(times) for kind, times in shared.items()}
    plain, secret = statistics.median(results["plain"]), statistics.median(results["secret"])
    print(f"init_dist_connection on {args.nprocs} CPU ranks (gloo, loopback), median of {args.reps} each:")
    print(f"  without a secret  {plain * 1e3:7.1f} ms")
    print(f"  with a secret     {secret * 1e3:7.1f} ms   (the proof: {(secret - plain) * 1e3:+.1f} ms, "
          f"{secret / plain:.2f}x)")  # fmt: skip


def _collect(rank: int, nprocs: int, ports: list[int], secret: str, shared: dict[str, list[float]]) -> None:
    results: dict[str, list[float]] = {}
    _rank(rank, nprocs, ports, secret, results)
    if rank == 0:
        shared.update(results)


if __name__ == "__main__":
    main()
