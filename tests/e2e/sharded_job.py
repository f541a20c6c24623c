"""A user's sharded training script, its Dataset and model its own: run by torchrun, ``ddpkit run`` and as one
process by tests/e2e/test_sharded.py.

    python tests/e2e/sharded_job.py EPOCHS CHECKPOINT_DIR OUT

trains to EPOCHS with ``FSDPPlugin`` (digits read as rows; a DataLoader with 2 workers, a global batch
of 30, a checkpoint every 4 steps) and writes, on rank 0, ``OUT`` (torch.save: the whole weights, and what
fraction of each weight every rank held).

Adam's ``eps`` is 1e-6: with torch's 1e-8, weights whose gradients are nearly 0 turn float rounding (the order
in which ranks sum, ~1e-7) into updates of ~1e-5 within a few steps, on DDP as on FSDP, and runs of 1 and 2
ranks part by ~1e-2 after 60 steps (measured on this script).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddpkit
from ddpkit.examples.digits import digits_datasets


class Rows(Dataset):
    """The first ``items`` digits of a split, each 8x8 image a sequence of 8 rows of 8 pixels."""

    def __init__(self, items: int, validation: bool) -> None:
        split = digits_datasets()[1 if validation else 0]
        self.images, self.labels = split.tensors[0][:items].float().view(-1, 8, 8) / 16.0, split.tensors[1][:items]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 3 * width), nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 24)
        self.layers = nn.ModuleList(Layer(24) for _ in range(3))
        self.out = nn.Linear(24 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x.flatten(1))


def main() -> None:
    epochs, checkpoint_dir, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    model = Net()
    loop = ddpkit.TrainLoop(
        model, DataLoader(Rows(571, validation=False), batch_size=5, shuffle=True, num_workers=2),
        DataLoader(Rows(97, validation=True), batch_size=5),
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-6),
        plugin=ddpkit.FSDPPlugin(), global_batch_size=30, checkpoint_dir=checkpoint_dir, checkpoint_every=4,
        progress=False,
    )  # fmt: skip
    loop.fit(epochs)
    weights = loop.full_state_dict()
    held = {name: p.to_local().numel() / p.numel() if hasattr(p, "to_local") else 1.0
            for name, p in loop.model.named_parameters()}  # fmt: skip
    fractions = [held]
    if dist.is_initialized():
        fractions = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(fractions, held)
    if ddpkit.get_rank() == 0:
        torch.save({"weights": weights, "held": fractions, "history": dict(loop.history)}, out)


if __name__ == "__main__":
    main()
