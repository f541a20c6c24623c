"""What the sharded-training tests share: a small transformer-like stack over the digits (each 8x8 image read as a
sequence of 8 rows of 8 pixels), its TrainLoop with ``FSDPPlugin``, and what a run leaves to compare.

Top-level names only: the session pool's workers and the launchers' processes import them by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from ddpkit import Callback, DDPPlugin, FSDPPlugin, TrainLoop, get_rank, get_world_size
from ddpkit.examples.digits import digits_datasets

#: Training items: 8 steps of the global batch and a last one of 1 item, which on 2 or 3 ranks one rank has a
#: batch in and the others do not (they run one that counts nothing: each forward of a sharded model is a collective).
TRAIN_ITEMS = 193
GLOBAL_BATCH = 24
BATCH = 4
#: Validation items: 2 ranks' shards are 10 and 9 batches of 4, 3 ranks' 7, 6 and 6.
VALIDATION_ITEMS = 73


class Rows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The digits as sequences: ``(8 rows, 8 pixels)`` scaled to [0, 1], and the label."""

    def __init__(self, items: int, validation: bool = False) -> None:
        train, val = digits_datasets()
        self.data = Subset(val if validation else train, range(items))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.data[index]
        return image.float().view(8, 8) / 16.0, label


#: Forwards of any ``Block`` that built a graph (training's, and activation checkpointing's recomputations).
BLOCK_FORWARDS = [0]
#: The dtypes of the weights the blocks computed with in training (FSDP's gathered ones under a sharded model).
COMPUTE_DTYPES: set[str] = set()


class Block(nn.Module):
    """Pre-norm residual MLP block (a transformer block without attention's softmax)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(8, 8)  # across the sequence
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            BLOCK_FORWARDS[0] += 1
            COMPUTE_DTYPES.add(str(self.mix.weight.dtype))
        x = x + self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    """Embedding, blocks, head: ``(N, 8, 8) -> (N, 10)``."""

    def __init__(self, width: int = 16, depth: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class Norms(Callback):
    """Each step's gradient norm (with clipping) and the rank's shard of every weight, as ``(numel, whole)``."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.shards: dict[str, tuple[int, int]] = {}

    def on_batch_end(self, train_loop: Any) -> None:
        if "grad_norm" in train_loop.step_metrics:
            self.norms.append(train_loop.step_metrics["grad_norm"])
        if not self.shards:
            for name, p in train_loop.model.named_parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                self.shards[name] = (local.numel(), p.numel())


def sharded_loop(
    checkpoint_dir: str | Path | None = None, *, sharded: bool = True, model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None, hsdp: bool | int = False, recompute: bool = False,
    **options: Any,
) -> TrainLoop:  # fmt: skip
    """The stack's TrainLoop over the digits rows (AdamW, a global batch of 24 in batches of 4); ``recompute``:
    activation checkpointing of the blocks."""
    policy = {Block} if recompute else None
    model = model if model is not None else Stack()
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(Rows(TRAIN_ITEMS), batch_size=BATCH, shuffle=True)
    validation = DataLoader(Rows(VALIDATION_ITEMS, validation=True), batch_size=BATCH)
    options.setdefault("global_batch_size", GLOBAL_BATCH)
    return TrainLoop(
        model, loader, validation, optimizer=optimizer, progress=False,
        plugin=FSDPPlugin(hsdp=hsdp, activation_checkpointing_policy=policy) if sharded
        else DDPPlugin(activation_checkpointing_policy=policy), checkpoint_dir=checkpoint_dir, **options,
    )  # fmt: skip


def fit_sharded(
    epochs: int, checkpoint_dir: str | None = None, callbacks: list[Callback] | None = None, accumulation: int = 1,
    **options: Any,
) -> dict[str, Any]:  # fmt: skip
    """Fit ``epochs`` (in all) and return what the tests compare: rank 0's whole weights, the history, every
    step's gradient norm, this rank's shard sizes and bytes held, the world size."""
    loop, norms = sharded_loop(checkpoint_dir, **options), Norms()
    BLOCK_FORWARDS[0] = 0
    COMPUTE_DTYPES.clear()
    try:
        loop.fit(epochs, accumulation, callbacks=[norms, *(callbacks or [])])
    except KeyboardInterrupt:
        return {"stopped": loop.global_step, "files": sorted(p.name for p in Path(checkpoint_dir or ".").iterdir())}
    weights = loop.full_state_dict()
    return {
        "weights": weights, "history": dict(loop.history), "norms": norms.norms, "shards": norms.shards,
        "memory": loop.plugin.memory(loop.model, loop.optimizer) if isinstance(loop.plugin, FSDPPlugin) else None,
        "rank": get_rank(), "world_size": get_world_size(), "mesh": _mesh(loop.model),
        "block_forwards": BLOCK_FORWARDS[0], "state_dict_keys": sorted(loop.model.state_dict()),
        "compute_dtypes": sorted(COMPUTE_DTYPES),
        "parameter_dtypes": sorted({str(p.dtype) for p in loop.model.parameters()}),
    }  # fmt: skip


def _mesh(model: nn.Module) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The device mesh the model's first parameter is sharded over: its shape and dimension names."""
    parameter = next(model.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    return (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ())) if mesh is not None else None


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different names: {sorted(a)} vs {sorted(b)}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
