"""A byte-level transformer language model trained by steps, sharded: `ddpkit run -n 2 examples/transformer_lm.py
--checkpoint-dir runs/lm --stop-at 30`, then `ddpkit run -n 3 examples/transformer_lm.py --checkpoint-dir runs/lm`
goes on from step 30 to step 60 on 3 ranks (or one process: `python examples/transformer_lm.py ...`).

The text is the first files of Python's standard library (no download): sequences of 64 bytes, each predicting
the next. A step budget (`max_steps`), an evaluation every 20 steps, a checkpoint every 30 written in the
background, activation checkpointing of each block, bf16 compute with float32 shards, and a callback that stops
the run at a step of its choice (its checkpoint is written before the run ends).
"""

import argparse
import os
import pathlib

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import ddpkit

LENGTH = 64  # bytes a sequence


class Bytes(Dataset):
    """``sequences`` sequences of the standard library's source: (LENGTH bytes, the LENGTH bytes that follow each)."""

    def __init__(self, sequences: int = 600) -> None:
        files = sorted(pathlib.Path(os.__file__).parent.glob("*.py"))
        text = b"".join(path.read_bytes() for path in files[:40])[: sequences * (LENGTH + 1)]
        self.data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        self.sequences = sequences

    def __len__(self) -> int:
        return self.sequences

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[index * (LENGTH + 1) : (index + 1) * (LENGTH + 1)]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    """One causal self-attention block: the unit that activation checkpointing recomputes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            width, 4, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        return self.layer(x, src_mask=mask, is_causal=True)


class LanguageModel(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))  # each block a unit of its own
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Loop(ddpkit.TrainLoop):
    def training_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    def predict_step(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        # one number a sequence is gathered, not its (LENGTH, 256) logits
        x, y = batch
        losses = nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="none")
        return losses.view(len(x), -1).mean(1), y[:, 0]

    def compute_metrics(self, predictions: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"loss": float(predictions.mean())}


class StopAt(ddpkit.Callback):
    """Stop the run after optimizer step ``step``, as a user's callback would (a time limit, a metric)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, trainer: ddpkit.TrainLoop) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--stop-at", type=int, default=None, help="a callback stops the run after this step")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "32"])
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--save", default=None, help="rank 0 writes the whole trained weights here (torch.save)")
    args = parser.parse_args()

    data = Bytes()
    torch.manual_seed(0)
    model = LanguageModel()
    optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # eps: see docs/sharded.md
        if args.optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    )
    loop = Loop(
        model,
        DataLoader(Subset(data, range(500)), batch_size=4, shuffle=True),
        DataLoader(Subset(data, range(500, 600)), batch_size=10),
        optimizer=optimizer,
        plugin=ddpkit.FSDPPlugin(activation_checkpointing_policy={Block}),
        precision=args.precision,
        global_batch_size=24,  # the same steps on 1, 2, 3, 4, 6, 8, 12 or 24 ranks
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=30,
        checkpoint_async=True,  # the shards are written while training goes on
        evaluate_every=20,
        progress=False,
    )
    history = loop.fit(max_steps=args.max_steps, callbacks=[StopAt(args.stop_at)] if args.stop_at else None)
    weights = loop.full_state_dict()  # every rank calls it; rank 0 gets the whole weights
    if ddpkit.get_rank() == 0:
        step, loss = history["eval_step"][-1], history["eval_loss"][-1]
        print(f"stopped after step {loop.global_step}; validation loss at step {step:.0f}: {loss:.4f} (nats a byte)")
        if args.save:
            torch.save(weights, args.save)


if __name__ == "__main__":
    main()
