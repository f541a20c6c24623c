"""The Lightning integration on a real ``Trainer(strategy="ddp", devices=2)``: sharded custom batch samplers and
validation metrics equal to a single-process evaluation of the same weights.

Here, the tests that need no process; the others are in tests/ranks/test_lightning.py and
tests/e2e/test_lightning.py.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.examples.lightning_digits import LightningDigitsConfig, digits_module
from ddpkit.examples.retrieval import EmbeddingNet
from ddpkit.integrations.lightning import ExtractorModuleDDP, ModuleDDP, PairwiseModuleDDP, PairwiseScorer

CONFIG = LightningDigitsConfig(epochs=2, val_batch_size=50)


def test_one_process_uses_the_loaders_as_given_without_warnings() -> None:
    config = replace(CONFIG, epochs=1)
    module = digits_module("extractor", config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = module.train_dataloader()
    assert loader is module.loaders_train
    assert not [w for w in caught if "ddpkit" in str(w.filename) or w.category.__name__ == "WarningDDP"]


def test_module_ddp_refuses_missing_or_wrong_loaders() -> None:
    with pytest.raises(ValueError, match=r"needs its loaders: pass loaders_train=.*both are None"):
        ModuleDDP()
    with pytest.raises(
        TypeError, match=r"loaders_val must be a DataLoader or a list or tuple of DataLoaders; got list"
    ):
        ModuleDDP(loaders_val=[DataLoader(range(3)), "not a loader"])  # type: ignore[list-item]
    only_val = ModuleDDP(loaders_val=(DataLoader(range(3)), DataLoader(range(4))))
    assert only_val.val_dataloader() == list(only_val.loaders_val)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="created with loaders_train=None, so it cannot be trained"):
        only_val.train_dataloader()
    assert ModuleDDP(loaders_train=DataLoader(range(3))).val_dataloader() == []
    with pytest.raises(ValueError, match="top_n=0 must be >= 1"):
        PairwiseModuleDDP(DataLoader(range(3)), pairwise_model=PairwiseScorer(4), top_n=0)


def test_batches_of_another_shape_are_named() -> None:
    extractor = EmbeddingNet()
    module = ExtractorModuleDDP(DataLoader(range(3)), extractor=extractor)
    assert module.unpack({"input_tensors": 1, "labels": 2}) == (1, 2)
    assert module.unpack((1, 2, 3)) == (1, 2)
    with pytest.raises(TypeError, match=r"dict with keys 'input_tensors' and 'labels'.*got Tensor"):
        module.unpack(torch.zeros(3))


# --- OML's signatures and dict batches ----------------------------------------------------------------


class _FreezableExtractor(torch.nn.Module):
    """OML's extractor interface: ``extract()`` for inference, ``freeze()``/``unfreeze()`` (IFreezable)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)  # type: ignore[no-any-return]

    def extract(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.fc(x)  # type: ignore[no-any-return]

    def freeze(self) -> None:
        self.calls.append("freeze")

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")


def test_extractor_module_takes_omls_arguments_positionally_and_by_keyword() -> None:
    net = _FreezableExtractor()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(range(3))
    # OML 4.0's order: loaders, then ExtractorModule(extractor, criterion, optimizer, scheduler, scheduler_interval,
    # scheduler_frequency, input_tensors_key, labels_key, embeddings_key, scheduler_monitor_metric, freeze_n_epochs)
    module = ExtractorModuleDDP(loader, None, net, None, optimizer, scheduler, "epoch", 2, "x", "y", "emb", "m", 1)
    assert module.model is module.extractor is net
    assert (module.input_tensors_key, module.labels_key, module.embeddings_key) == ("x", "y", "emb")
    assert module.configure_optimizers() == (
        [optimizer], [{"scheduler": scheduler, "interval": "epoch", "frequency": 2}]
    )  # fmt: skip
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    keywords = ExtractorModuleDDP(
        loaders_train=loader, extractor=net, optimizer=optimizer, scheduler=plateau, scheduler_monitor_metric="m"
    )
    assert keywords.configure_optimizers()[1] == [{"scheduler": plateau, "interval": "step", "frequency": 1,
                                                   "monitor": "m"}]  # fmt: skip
    module.on_train_epoch_start()  # epoch 0 of freeze_n_epochs=1: frozen
    assert net.calls == ["freeze"]
    with pytest.raises(TypeError, match=r"OML's arguments, loaders first: ExtractorModuleDDP\(loaders_train, "):
        ExtractorModuleDDP(net, None, optimizer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"freeze_n_epochs=2 needs a model with freeze\(\) and unfreeze\(\)"):
        ExtractorModuleDDP(loader, extractor=EmbeddingNet(), freeze_n_epochs=2)
    with pytest.raises(ValueError, match="needs extractor="):
        ExtractorModuleDDP(loader)


def test_omls_dict_batches_train_and_validate_with_the_given_keys() -> None:
    net = _FreezableExtractor()
    seen: list[torch.Tensor] = []

    def criterion(embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        seen.append(labels)
        return embeddings.pow(2).mean()

    module = ExtractorModuleDDP(
        DataLoader(range(3)), extractor=net, criterion=criterion, input_tensors_key="x", labels_key="y",
        embeddings_key="emb",
    )  # fmt: skip
    batch = {"x": torch.ones(2, 4), "y": torch.tensor([0, 1]), "paths": ["a.jpg", "b.jpg"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # self.log without a Trainer
        loss = module.training_step(batch, 0)
        output = module.validation_step(batch, 0)
    assert loss.requires_grad
    assert torch.equal(seen[0], batch["y"])
    assert output.keys() == {"x", "y", "paths", "emb"}, "OML's validation output: the batch and its embeddings"
    assert torch.equal(output["emb"], net.extract(batch["x"]).detach()), "extract(), as OML's validation_step"
