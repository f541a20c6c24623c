"""A torchrun-style script, run unchanged: `ddpkit run -n 2 examples/train.py --epochs 3` (or torchrun).

With a GPU for every rank of the node, each rank trains on its own (``cuda:<LOCAL_RANK>``, NCCL); else on CPU
with gloo."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

import ddpkit
from ddpkit.examples.digits import digits_datasets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and local_ranks <= torch.cuda.device_count()  # one GPU for every rank
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # one GPU per rank: this rank's
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads RANK, WORLD_SIZE, MASTER_*
    train_set, val_set = digits_datasets()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    model = DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_sampler = ddpkit.DistributedSamplerWrapper(RandomSampler(train_set))  # each rank its share
    train_loader = DataLoader(train_set, batch_size=32, sampler=train_sampler)
    for _ in range(args.epochs):  # a new iteration is a new epoch: no set_epoch to forget
        for inputs, targets in train_loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()  # DDP all-reduces the gradients
            optimizer.step()

    val_sampler = ddpkit.DistributedSamplerWrapper(SequentialSampler(val_set))
    with torch.no_grad():
        val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)
        predictions = torch.cat([model(x.to(device)).argmax(1) for x, _ in val_loader])
    predictions = ddpkit.gather_in_order(predictions, val_sampler)  # every sample once, in order
    if dist.get_rank() == 0:
        accuracy = (predictions.cpu() == val_set.tensors[1]).double().mean().item()
        print(f"{dist.get_world_size()} ranks, {args.epochs} epochs: validation accuracy {accuracy:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
