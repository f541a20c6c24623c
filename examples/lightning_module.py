"""OML's ExtractorModuleDDP under a Lightning Trainer on 2 CPU processes: `python examples/lightning_module.py`.

Needs the extra: `.venv/bin/pip install -c constraints.txt -e '.[lightning]'` (the dev install has it).
"""

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.retrieval import BalancedBatchSampler, EmbeddingNet  # OML-style P x K sampler, small net
from ddpkit.integrations.lightning import ExtractorModuleDDP


def main() -> None:
    train_set, val_set = digits_datasets()
    pl.seed_everything(0, verbose=False)
    extractor = EmbeddingNet()  # (B, 64) pixels -> (B, 32) normalised embeddings
    module = ExtractorModuleDDP(  # OML's arguments: loaders first, then OML's ExtractorModule's
        loaders_train=DataLoader(train_set, batch_sampler=BalancedBatchSampler(train_set.tensors[1], 8, 4)),
        loaders_val=DataLoader(val_set, batch_size=64),
        extractor=extractor,
        criterion=None,  # None is the triplet loss with every rank's negatives
        optimizer=torch.optim.SGD(extractor.parameters(), lr=0.1, momentum=0.9),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        use_distributed_sampler=False,  # the module's loaders are sharded already
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)  # the module holds its loaders: none are passed here
    if trainer.is_global_zero:  # the whole validation split, on every rank
        print(f"precision_at_1 {module.validation_metrics['precision_at_1']:.4f}")


if __name__ == "__main__":
    main()
