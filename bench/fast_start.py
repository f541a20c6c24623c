"""Time to the first training step, and per epoch: TrainLoop.fit_distributed against Lightning's Trainer.

    .venv/bin/python bench/fast_start.py [--epochs 10] [--reps 3]

Both train the demo's model on the digits (batch 32 per rank, SGD 0.1 with
momentum 0.9) on 2 CPU processes with gloo, each run in a fresh Python process
(the way a user starts a script), the two alternating. Rank 0 records, in wall
time since its process started (before any import): the end of the first
optimizer step, and the end of each epoch. ddpkit runs twice, its workers
started by ``spawn`` (the default) and by ``forkserver``. Reported: medians
over the runs, and ddpkit / Lightning ratios. Targets: time to the first step
<= 1.0 x Lightning's, time per epoch <= 0.5 x Lightning's, wall time <= 1.0 x.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

DDPKIT = textwrap.dedent(
    """\
    import time
    START = time.time()
    import json, sys
    import ddpkit
    from ddpkit.examples.demo import DemoConfig, digits_train_loop


    class Times(ddpkit.Callback):
        def __init__(self, path, start):
            self.path, self.start, self.first, self.epochs = path, start, None, []

        def on_batch_end(self, loop):
            if self.first is None:
                self.first = time.time() - self.start

        def on_epoch_end(self, loop):
            self.epochs.append(time.time() - self.start)

        def on_train_end(self, loop):
            if ddpkit.get_rank() == 0:
                with open(self.path, "w") as handle:
                    json.dump({"first_step": self.first, "epochs": self.epochs}, handle)


    if __name__ == "__main__":
        epochs = int(sys.argv[2])
        loop = digits_train_loop(DemoConfig(epochs=epochs, progress=False))
        loop.fit_distributed(
            epochs, num_processes=2, callbacks=[Times(sys.argv[1], START)], backend="gloo", start_method=sys.argv[3]
        )
    """
)

LIGHTNING = textwrap.dedent(
    """\
    import time
    START = time.time()
    import json, logging, sys, warnings
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from ddpkit.examples.demo import build_model
    from ddpkit.examples.digits import digits_datasets


    class Digits(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = build_model()

        def training_step(self, batch, index):
            inputs, targets = batch
            return nn.functional.cross_entropy(self.model(inputs), targets)

        def validation_step(self, batch, index):
            inputs, targets = batch
            self.log("val_loss", nn.functional.cross_entropy(self.model(inputs), targets), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


    class Times(pl.Callback):
        def __init__(self, path):
            self.path, self.first, self.epochs = path, None, []

        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            if self.first is None:
                self.first = time.time() - START

        def on_validation_epoch_end(self, trainer, module):
            self.epochs.append(time.time() - START)

        def on_fit_end(self, trainer, module):
            if trainer.is_global_zero:
                with open(self.path, "w") as handle:
                    json.dump({"first_step": self.first, "epochs": self.epochs}, handle)


    if __name__ == "__main__":
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        epochs = int(sys.argv[2])
        train, val = digits_datasets()
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[Times(sys.argv[1])],
        )
        trainer.fit(Digits(), DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=256))
    """
)


def run(script: str, epochs: int, directory: Path, *extra: str) -> dict[str, float]:
    """One run in a fresh process: time to the first step, median epoch time, wall time (seconds)."""
    path, out = directory / "script.py", directory / "times.json"
    path.write_text(script)
    out.unlink(missing_ok=True)
    started = time.time()
    command = [sys.executable, str(path), str(out), str(epochs), *extra]
    subprocess.run(command, check=True, capture_output=True, cwd=directory)
    wall = time.time() - started
    times = json.loads(out.read_text())
    ends = times["epochs"]
    per_epoch = statistics.median(b - a for a, b in itertools.pairwise(ends))
    return {"first_step": times["first_step"], "per_epoch": per_epoch, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    variants = {
        "ddpkit spawn": (DDPKIT, "spawn"),
        "ddpkit forkserver": (DDPKIT, "forkserver"),
        "lightning": (LIGHTNING, "-"),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.reps):
            for name, (script, method) in variants.items():
                results[name].append(run(script, args.epochs, Path(directory), method))
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"digits, 2 CPU processes (gloo), {args.epochs} epochs, {args.reps} alternating runs each (medians)")
    print(f"{'':26} {'lightning':>10} {'spawn':>8} {'ratio':>6} {'forkserver':>11} {'ratio':>6}  target")
    for key, label, target in (
        ("first_step", "time to first step (s)", 1.0),
        ("per_epoch", "time per epoch (s)", 0.5),
        ("wall", "wall time of the run (s)", 1.0),
    ):
        theirs = medians["lightning"][key]
        cells = []
        for name in ("ddpkit spawn", "ddpkit forkserver"):
            ours = medians[name][key]
            cells.append(f"{ours:8.3f} {ours / theirs:6.2f}")
        ratios = [medians[name][key] / theirs for name in ("ddpkit spawn", "ddpkit forkserver")]
        verdict = ", ".join(f"{'ok' if r <= target else 'MISSED'}" for r in ratios)
        print(f"{label:26} {theirs:10.3f} {cells[0]} {cells[1]:>18}  <= {target:g}: {verdict}")


if __name__ == "__main__":
    main()
