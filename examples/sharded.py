"""Sharded training: `ddpkit run -n 2 examples/sharded.py --epochs 2 --checkpoint-dir runs/sharded`, then the same
with `-n 3 ... --epochs 3` goes on from the 2 ranks' checkpoint on 3 (or torchrun, srun, mpirun).

A small transformer-like stack over the digits, each 8x8 image read as a sequence of 8 rows of 8 pixels. With
``plugin=ddpkit.FSDPPlugin()`` each rank holds 1/W of every weight, gradient and optimizer state."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ddpkit
from ddpkit.examples.digits import digits_datasets


class Rows(Dataset):
    """The digits as sequences of 8 rows of 8 pixels, in [0, 1]."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images.float().view(-1, 8, 8) / 16.0, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Classifier(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))  # each block is a unit of its own
        self.head = nn.Linear(8 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--hsdp", action="store_true", help="shard inside each node, replicate across nodes")
    args = parser.parse_args()
    (train_images, train_labels), (val_images, val_labels) = (d.tensors for d in digits_datasets())
    torch.manual_seed(0)
    model = Classifier()
    loop = ddpkit.TrainLoop(
        model,
        DataLoader(Rows(train_images, train_labels), batch_size=8, shuffle=True),
        DataLoader(Rows(val_images, val_labels), batch_size=64),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6),  # eps: see docs/sharded.md
        plugin=ddpkit.FSDPPlugin(hsdp=args.hsdp),  # the one change from DDP
        global_batch_size=96,  # the same steps on 1, 2, 3, 4, 6 or 12 ranks
        checkpoint_dir=args.checkpoint_dir,  # a sharded checkpoint: resumes on any number of ranks
        gradient_clip_norm=1.0,
        progress=False,
    )
    history = loop.fit(args.epochs)
    weights = loop.full_state_dict()  # every rank calls it; rank 0 gets the whole weights
    held = loop.plugin.memory(loop.model, loop.optimizer)
    if ddpkit.get_rank() == 0:
        whole = sum(w.numel() * w.element_size() for w in weights.values())
        ranks = ddpkit.get_world_size()
        print(
            f"{ranks} rank{'s' if ranks > 1 else ''}, {args.epochs} epochs: validation accuracy "
            f"{history['validation_accuracy'][-1]:.4f}; rank 0 holds {held['parameters']} of {whole} bytes of weights"
        )


if __name__ == "__main__":
    main()
