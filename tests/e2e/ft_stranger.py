"""A stranger to a fault-tolerant job, with torchft's own classes: ``python -m tests.e2e.ft_stranger MODE LIGHTHOUSE
OUT SECONDS``.

It knows the lighthouse's address (``ss -ltn`` and ``GET /status`` show it) and the model (the job's script
is no secret). For ``SECONDS`` it takes part in the job's quorums as a replica group of its own (torchft's
``Manager``, ``ProcessGroupGloo`` and ``PGTransport``, replica id ``stranger``):

* ``join``: from step 0: if a quorum makes it recover, it asks for the run's state; every step it
  all-reduces a gradient of the model's size (and four numbers riding along, as ddpkit's groups do) all
  1e6, and commits what it can;
* ``claim``: it says it is at step 10**6, so that it is the quorum's only up-to-date group and everyone's
  recovery source, and serves a state holding a pickled command that would create ``OUT.marker``.

It writes what it got to ``OUT.json``: the quorums it was in, whether a state reached it, what it was asked
to send and whether that went through, its all-reduces that completed, its commits, when it left.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]


class Command:
    """Unpickling it runs a shell command (what a pickled "state" can do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (self.command,))


def main(mode: str, lighthouse: str, out: str, seconds: float) -> None:
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from ddpkit.examples.demo import build_model

    report: dict[str, Any] = {"quorums": 0, "received": False, "asked_to_send": [], "sent": 0, "all_reduced": 0,
                              "commits": 0, "errors": []}  # fmt: skip

    def save() -> None:
        with open(f"{out}.json", "w") as handle:
            json.dump(report, handle)

    size = sum(parameter.numel() for parameter in build_model().parameters()) + 4
    timeout = timedelta(seconds=5)
    group = ProcessGroupGloo(timeout=timeout)

    class Transport(PGTransport):  # type: ignore[type-arg]
        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            state = super().recv_checkpoint(*args, **kwargs)
            report["received"] = True
            save()
            return state

        def send_checkpoint(self, dst_ranks: list[int], *args: Any, **kwargs: Any) -> None:
            report["asked_to_send"].append(list(dst_ranks))
            super().send_checkpoint(dst_ranks, *args, **kwargs)
            report["sent"] += 1
            save()

    def state_dict() -> dict[str, Any]:
        if mode == "claim":
            return {"command": Command(f"touch {out}.marker"), "weights": torch.zeros(size)}
        return {"weights": torch.zeros(size)}

    def load_state_dict(state: Any) -> None:
        report["received"] = True
        save()

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=group, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id="stranger", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname="127.0.0.1", timeout=timeout, quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout, checkpoint_transport=Transport(group, timeout=timeout, device=torch.device("cpu")),
    )  # fmt: skip
    if mode == "claim":
        manager.load_state_dict({"step": 10**6, "batches_committed": 0})
    save()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            manager.start_quorum()
            manager.wait_quorum()
            report["quorums"] += 1
            flat = torch.full((size,), 1e6)
            manager.allreduce(flat).wait()
            if manager.errored() is None:
                report["all_reduced"] += 1
            if manager.should_commit():
                report["commits"] += 1
        except Exception as exc:  # keep trying, as a stranger would
            report["errors"].append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        save()
    manager.shutdown(wait=False)
    report["ended"] = time.time()
    save()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
