"""One replica group of the fault tolerance tests: ``python -m tests.e2e.ft_replica ID LIGHTHOUSE STEPS OUT DELAY``.

Trains the digits classifier on batches of its own (seeded by the replica's
number) through :class:`ddpkit.fault_tolerance.ReplicaGroup`, one JSON line per
step to ``OUT.jsonl`` (time, committed steps, whether this one was committed,
the quorum's size, the process id), and the final weights to ``OUT.pt``.

With ``$FT_RESTART_MARKER`` (a path), a group started with ``$FT_RESTARTED=1`` creates that file once it has
joined (its manager heartbeats); with ``$FT_WAIT_FOR``, the groups wait for that file after step
``$FT_WAIT_AT`` (at most 120 s). Both at one path: a restarted group is sure to find peers to heal from
however slowly it starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from ddpkit.examples.demo import build_model
from ddpkit.examples.digits import digits_datasets
from ddpkit.fault_tolerance import ReplicaGroup


def main(replica: str, lighthouse: str, steps: int, out: str, delay: float) -> None:
    images, labels = digits_datasets(seed=0)[0].tensors
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(int(replica.lstrip("r")))

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    group = ReplicaGroup(lighthouse, replica, state_dict, load_state_dict, timeout=5.0, quorum_timeout=30.0)
    marker, wait_for = os.environ.get("FT_RESTART_MARKER"), os.environ.get("FT_WAIT_FOR")
    wait_at = int(os.environ.get("FT_WAIT_AT", "-1"))
    if marker and os.environ.get("FT_RESTARTED") == "1":
        open(marker, "w").close()
    with open(f"{out}.jsonl", "w") as log:
        while group.step < steps:
            group.start_step()
            index = torch.randint(0, len(labels), (32,), generator=generator)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images[index]), labels[index]).backward()
            group.average_gradients(model.parameters())
            committed = group.commit()
            if committed:
                optimizer.step()
            record = {"t": time.time(), "step": group.step, "committed": committed,
                      "participants": group.participants, "pid": os.getpid()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
            log.flush()
            time.sleep(delay)
            deadline = time.monotonic() + 120.0
            while wait_for and group.step == wait_at and not os.path.exists(wait_for) and time.monotonic() < deadline:
                time.sleep(0.1)
    torch.save(model.state_dict(), f"{out}.pt")
    group.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5]))
