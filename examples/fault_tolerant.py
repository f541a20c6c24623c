"""A replica group of a fault-tolerant job: `ddpkit run --fault-tolerance -n 3 examples/fault_tolerant.py`.

Each process is one group (or, with `--group-size M`, each M processes); `ddpkit run --fault-tolerance` starts the
lighthouse and sets torchft's TORCHFT_LIGHTHOUSE and REPLICA_GROUP_ID for each. Kill one (`kill -9`): the others
go on, it comes back and heals. With `--sharded` each group shards the model over its ranks (`FSDPPlugin()`:
`--group-size 2` and up), and the groups replicate it.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import FSDPPlugin, TrainLoop, get_rank
from ddpkit.examples.digits import digits_datasets

train_set, val_set = digits_datasets()
torch.manual_seed(0)  # every group starts from the same weights (a group that comes back takes them from a peer)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
loop = TrainLoop(
    model,
    DataLoader(train_set, batch_size=32, shuffle=True),
    DataLoader(val_set, batch_size=100),
    optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
    global_batch_size=64,  # items per optimizer step over all groups, however many are alive
    fault_tolerance="torchft",  # the lighthouse and this group's name from torchft's variables
    plugin=FSDPPlugin() if "--sharded" in sys.argv else None,  # None: DDPPlugin()
    progress=False,
)
history = loop.fit(2)
if get_rank() == 0:  # once per group (its first rank)
    print(f"validation accuracy {history['validation_accuracy'][-1]:.3f}")
