"""What the quorum proof costs: configuring the replica groups' process group for a new quorum with a job secret
(every member proves it) against torchft's own configuration.

    .venv/bin/python bench/quorum_proof.py [--reps 20] [--members 2]

Each repetition configures ``--members`` groups for a new quorum (threads of this process, one per member, a
TCPStore on loopback as the quorum's store), with ddpkit's group and a secret, and with torchft's
``ProcessGroupGloo``, alternating. Reported: the median wall time of a configuration (the slowest member's),
both ways, their difference (the check that the quorum's store is a member's, the signed addresses, and the
proof: two all-gathers of a nonce, a tag and each member's view of its connections) and the ratio. torchft
configures the group only when the quorum changes (a group joined or left, or a step failed), not every step.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from datetime import timedelta
from typing import Any


def _configure(groups: list[Any], ids: list[str], store_port: int, quorum_id: int) -> float:
    members = len(groups)
    address = f"127.0.0.1:{store_port}/torchft/{quorum_id}/0"
    times = [0.0] * members
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        started = time.perf_counter()
        try:
            groups[rank].configure(address, ids[rank], rank, members, quorum_id, 0, 1, list(range(members)))
        except BaseException as exc:
            errors.append(exc)
        times[rank] = time.perf_counter() - started

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(members)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--members", type=int, default=2)
    args = parser.parse_args()
    import torchft
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from ddpkit.fault_tolerance._quorum_proof import claim_store, proven_gloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ids = [f"group-{rank}:{uuid.uuid4()}" for rank in range(args.members)]  # torchft's NAME:uuid
    claim_store(f"127.0.0.1:{store.port}", ids[0], b"bench")  # the quorum's store is group-0's
    plain = [torchft.ProcessGroupGloo(timeout=timedelta(seconds=30)) for _ in ids]
    proven = [proven_gloo(b"bench", 30.0, lambda: ids) for _ in ids]
    results: dict[str, list[float]] = {"plain": [], "secret": []}
    for quorum in range(2 * args.reps):
        kind = "secret" if quorum % 2 else "plain"
        results[kind].append(_configure(proven if kind == "secret" else plain, ids, store.port, quorum))
    without, with_secret = statistics.median(results["plain"]), statistics.median(results["secret"])
    print(f"configuring a quorum of {args.members} replica groups (gloo, loopback), median of {args.reps} each:")
    print(f"  torchft's group   {without * 1e3:7.1f} ms")
    print(f"  with the proof    {with_secret * 1e3:7.1f} ms   (the proof: {(with_secret - without) * 1e3:+.1f} ms, "
          f"{with_secret / without:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
