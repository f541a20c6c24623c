"""Per-step fault tolerance on torchft: replica groups that lose a member and go on without a restart.

torchft (``pip install torchft==0.2.0``, ddpkit's ``ft`` extra) runs a quorum every optimizer step:
the replica groups heartbeat a lighthouse, a step that failed anywhere is
committed nowhere, the healthy groups go on with the next quorum in the same
processes, and a group that comes back takes the weights live from a healthy
peer. ddpkit starts torchft's servers on one address each, as it does its own
stores (loopback for one machine; the address that reaches the others on
several). With a job secret every quorum's members prove that they hold it
before anything moves between them, and a recovering group's state moves over
the groups' process group as tensors and plain values, never unpickled.

- :func:`serve_lighthouse`: torchft's lighthouse, listening on one address.
- :class:`ReplicaGroup`: one replica group in the job (one process, or every rank of a process group):
  the step's quorum, the gradients averaged over its participants, the commit.

- :class:`TorchFT`: the settings of ``TrainLoop(fault_tolerance=...)``, which trains as one replica group.
- :class:`JobEnded`: a replica group has nothing left to train (the job finished, or cannot go on);
  :class:`RecordUnreachableError`: no job's record answers beside the lighthouse.
"""

from ddpkit.fault_tolerance._lighthouse import Lighthouse, serve_lighthouse
from ddpkit.fault_tolerance._quorums import JobEnded
from ddpkit.fault_tolerance._record import RecordUnreachableError
from ddpkit.fault_tolerance._replica import ReplicaGroup
from ddpkit.fault_tolerance._settings import TorchFT, torchft_settings

__all__ = [
    "JobEnded",
    "Lighthouse",
    "RecordUnreachableError",
    "ReplicaGroup",
    "TorchFT",
    "serve_lighthouse",
    "torchft_settings",
]
