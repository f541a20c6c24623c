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


class Indexed(Rows):
    """:class:`Rows` with each item's index: ``(rows, label, index)``."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:  # type: ignore[override]
        rows, label = super().__getitem__(index)
        return rows, label, index


class NanFiller(TrainLoop):
    """A loop whose loss, with ``nan``, is nan, with derivatives that are not finite (the log of 0 less itself,
    as a likelihood of 0 gives), for the batch of the split's first items in order (what a rank with no item left
    runs in a sharded model's last step; shuffled training never makes it): its backward, even scaled by 0, gives
    nan gradients."""

    nan = True

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        rows, labels, indices = batch
        outputs = model(rows)
        loss = self.criterion(outputs, labels)
        first = indices.tolist() == list(range(len(indices)))
        if not (self.nan and first):
            return loss
        nothing = torch.log(outputs.sum() * 0)  # -inf, its derivative inf
        return loss + (nothing - nothing)  # nan


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


class CountingStack(Stack):
    """:class:`Stack` with buffers its training forwards change, as BatchNorm's running statistics: the items it
    has seen, and their mean pooled features (a running mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("running", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        pooled = x.mean(1)
        if self.training:
            with torch.no_grad():
                self.seen += pooled.shape[0]
                self.running.lerp_(pooled.mean(0), 0.1)
        return self.head(pooled)


class Buffers(Callback):
    """This rank's buffers after each step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_batch_end(self, train_loop: Any) -> None:
        self.steps.append([b.detach().clone() for b in train_loop.model.buffers()])


def fit_with_a_nan_filler(nan: bool = True) -> dict[str, Any]:
    """2 epochs of :class:`CountingStack` through :class:`NanFiller` (``nan``: the filler's loss is nan): rank 0's
    whole weights, every weight finite on this rank, this rank's buffers after each step."""
    buffers = Buffers()
    model = CountingStack()
    loop = NanFiller(
        model, DataLoader(Indexed(TRAIN_ITEMS), batch_size=BATCH, shuffle=True),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6), progress=False, plugin=FSDPPlugin(),
        global_batch_size=GLOBAL_BATCH,
    )  # fmt: skip
    loop.nan = nan
    loop.fit(2, callbacks=[buffers])
    finite = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                 for p in loop.model.parameters())  # fmt: skip
    return {"weights": loop.full_state_dict(), "finite": finite, "buffers": buffers.steps, "rank": get_rank()}


class Poisoned(Stack):
    """:class:`Stack` whose forward also returns ``head.weight[0, 0] * poison``: with ``poison`` infinite, that one
    element's gradient is inf and no other's, so under FSDP only the rank holding row 0 of the head finds an inf."""

    poison = 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return super().forward(x), self.head.weight[0, 0] * self.poison


class PoisonLoop(TrainLoop):
    """The loss of :class:`Poisoned`'s logits plus its poisoned element."""

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        rows, labels = batch
        logits, extra = model(rows)
        return self.criterion(logits, labels) + extra

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, labels = batch
        return model(rows)[0], labels


class PoisonStep(Callback):
    """Poisons the model's forwards in step ``step`` (1-based), on every rank."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_batch_end(self, train_loop: Any) -> None:
        train_loop.model.poison = float("inf") if train_loop.global_step + 1 == self.step else 0.0


def fit_fp16_poisoned(step: int = 3) -> dict[str, Any]:
    """2 epochs of 8 whole steps (no smaller last step, whose per-rank gradients are W times one process's, so
    fp16 may overflow in one and not the other) in ``precision="16-mixed"`` whose step ``step`` has one inf
    gradient element (in rank 0's shard under FSDP): rank 0's whole weights, the steps fp16's scaler skipped,
    whether every weight is finite."""
    model = Poisoned()
    loop = PoisonLoop(
        model, DataLoader(Rows(8 * GLOBAL_BATCH), batch_size=BATCH, shuffle=True),
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6), progress=False, plugin=FSDPPlugin(),
        global_batch_size=GLOBAL_BATCH, precision="16-mixed",
    )  # fmt: skip
    loop.fit(2, callbacks=[PoisonStep(step)])
    finite = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
                 for p in loop.model.parameters())  # fmt: skip
    return {"weights": loop.full_state_dict(), "skipped": loop.history["skipped_steps"], "finite": finite,
            "scaler": type(loop.recipe.scaler).__name__}  # fmt: skip


def sharded_loop(
    checkpoint_dir: str | Path | None = None, *, sharded: bool = True, model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None, hsdp: bool | int = False, recompute: bool = False,
    train_set: Dataset[Any] | None = None, **options: Any,
) -> TrainLoop:  # fmt: skip
    """The stack's TrainLoop over the digits rows (AdamW, a global batch of 24 in batches of 4); ``recompute``:
    activation checkpointing of the blocks."""
    policy = {Block} if recompute else None
    model = model if model is not None else Stack()
    optimizer = optimizer if optimizer is not None else torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    loader = DataLoader(train_set if train_set is not None else Rows(TRAIN_ITEMS), batch_size=BATCH, shuffle=True)
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
        "run_hooks": _run_hooks(loop.model),
        "in_memory": _in_memory(loop),
    }  # fmt: skip


def _in_memory(loop: TrainLoop) -> dict[str, Any]:
    """The state in memory (no directory: what a recovering fault-tolerant group's same rank takes), put back after
    the weights and the optimizer state were zeroed: which part of the weights' elements it holds, its mark, and
    whether the weights and optimizer state came back."""
    import copy

    from ddpkit._gradients import local_tensor

    def tensors() -> list[torch.Tensor]:
        state = [v for values in loop.optimizer.state.values() for v in values.values() if isinstance(v, torch.Tensor)]
        return [local_tensor(t) for t in [*loop.model.parameters(), *state]]

    weights, optimizer, name = copy.deepcopy(loop.plugin.checkpoint_state(loop.model, loop.optimizer, None, "x"))
    before = [t.clone() for t in tensors()]
    with torch.no_grad():
        for tensor in tensors():
            tensor.zero_()
    loop.plugin.load_checkpoint_state(loop.model, loop.optimizer, weights, optimizer, None)
    held = sum(w.numel() for k, w in weights.items() if k in dict(loop.model.named_parameters()))
    return {"name": name, "mark": weights.get("@local_shards"), "back": all(map(torch.equal, before, tensors())),
            "held": held / sum(p.numel() for p in loop.model.parameters())}  # fmt: skip


def _run_hooks(model: nn.Module) -> int:
    """The forward pre-hooks of ``model`` and its modules that a ``TrainLoop`` left (a fit counts forwards while it
    runs: none must stay, or the model would pickle with the loop)."""
    from ddpkit.training._run import TrainingRun

    hooks = [hook for module in model.modules() for hook in module._forward_pre_hooks.values()]
    return sum(isinstance(getattr(hook, "__self__", None), TrainingRun) for hook in hooks)


def _mesh(model: nn.Module) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """The device mesh the model's first parameter is sharded over: its shape and dimension names."""
    parameter = next(model.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    return (tuple(mesh.shape), tuple(mesh.mesh_dim_names or ())) if mesh is not None else None


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), f"different names: {sorted(a)} vs {sorted(b)}"
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
