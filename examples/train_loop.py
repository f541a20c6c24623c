"""Single-process training code that becomes DDP: `python examples/train_loop.py` (2 CPU processes)."""

import torch
from torch import nn
from torch.utils.data import DataLoader

import ddpkit
from ddpkit.examples.digits import digits_datasets  # the bundled UCI digits: 8x8 images as 64 floats


def main() -> None:
    train_set, val_set = digits_datasets()  # 1438 training and 359 validation samples
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    loop = ddpkit.TrainLoop(
        model,
        DataLoader(train_set, batch_size=32, shuffle=True),  # any sampler or batch sampler
        DataLoader(val_set, batch_size=256),
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),  # default: Adam, lr 1e-3
        criterion=nn.CrossEntropyLoss(),  # the default
        checkpoint_dir="runs/digits",  # a second run resumes from here (or says it is done)
        checkpoint_every=20,  # optional: resume at the exact batch
    )
    history = loop.fit_distributed(5, num_processes=2, max_restarts=1)  # or loop.fit(5) in this process
    print(f"validation accuracy after 5 epochs: {history['validation_accuracy'][-1]:.4f}")


if __name__ == "__main__":  # required: the workers are spawned and import this file
    main()
