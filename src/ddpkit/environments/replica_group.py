"""Where a process sits in a fault-tolerant job: the variables that name its lighthouse and its replica group
(torchft's own), and how many groups the job starts (ddpkit's).

``ddpkit run --fault-tolerance`` and ``fit_distributed`` set them for each group; ``TorchFT()`` reads them.
"""

from __future__ import annotations

__all__ = ["GROUPS_VARIABLE", "LIGHTHOUSE_VARIABLE", "REPLICA_ID_VARIABLE"]

#: torchft's own variables: the lighthouse's address, and this replica group's id (its examples' name).
LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_VARIABLE = "REPLICA_GROUP_ID"
#: ddpkit's: how many replica groups the job starts (``ddpkit run --fault-tolerance`` and ``fit_distributed`` set it).
GROUPS_VARIABLE = "DDPKIT_REPLICA_GROUPS"
