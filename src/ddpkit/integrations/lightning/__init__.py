"""Lightning modules whose loaders are sharded by ddpkit (OML's ``ddp`` section).

``ModuleDDP`` holds its loaders and hands them to the ``Trainer`` patched with
:func:`~ddpkit.patch_dataloader_to_ddp`, so custom samplers and batch samplers
work under ``Trainer(strategy="ddp", use_distributed_sampler=False)``: each
rank gets its own share of every epoch, instead of Lightning replacing a custom
sampler or every rank seeing everything. ``ExtractorModuleDDP`` trains an
embedding extractor (negatives from every rank) and ``PairwiseModuleDDP`` a
pairwise re-ranker; both report precision@1 over the whole validation split,
equal to a single-process evaluation of the same weights.

Needs the optional extra: ``pip install lightning``, ddpkit's ``lightning`` extra (Lightning 2.x).
The rest of ddpkit never imports Lightning.

The constructors take OML's arguments (``loaders_train``, ``loaders_val``,
then those of OML's ``ExtractorModule`` / ``PairwiseModule``), so OML code runs
unchanged; batches are dicts keyed by ``input_tensors_key``, ``labels_key`` and
(for OML's pairs miner) ``embeddings_key``, or ``(inputs, labels, ...)`` tuples.

Example::

    model = ExtractorModuleDDP(loaders_train=train_loader, loaders_val=val_loader,
                               extractor=extractor, criterion=None, optimizer=optimizer)
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
                      use_distributed_sampler=False, max_epochs=5)
    trainer.fit(model)          # no loaders here: the module holds them
    model.validation_metrics    # {"precision_at_1": ...}, the same on every rank
"""

from __future__ import annotations

try:
    import lightning.pytorch  # noqa: F401 (fail here, with the fix, when the extra is missing)
except ModuleNotFoundError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ModuleNotFoundError(
        "ddpkit.integrations.lightning needs Lightning 2.x, which is not installed: pip install lightning "
        "(ddpkit's lightning extra)",
        name=exc.name,
    ) from exc

from ddpkit.integrations.lightning.extractor import ExtractorModuleDDP
from ddpkit.integrations.lightning.module_ddp import ModuleDDP
from ddpkit.integrations.lightning.pairwise import PairwiseModuleDDP, PairwiseScorer

__all__ = ["ExtractorModuleDDP", "ModuleDDP", "PairwiseModuleDDP", "PairwiseScorer"]
