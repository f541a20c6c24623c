"""The Lightning integration on a real ``Trainer(strategy="ddp", devices=2)``: sharded custom batch samplers and
validation metrics equal to a single-process evaluation of the same weights.

Here, the tests that run on the ranks of the session pool; the others are in tests/unit/test_lightning.py and
tests/e2e/test_lightning.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import DDPSamplerWrapper
from ddpkit.examples.digits import digits_datasets
from ddpkit.examples.lightning_digits import LightningDigitsConfig, digits_module, digits_trainer
from ddpkit.examples.retrieval import BalancedBatchSampler, EmbeddingNet
from ddpkit.integrations.lightning import PairwiseModuleDDP, PairwiseScorer
from ddpkit.metric_learning import distances, precision_at_1
from ddpkit.testing import run_parallel

CONFIG = LightningDigitsConfig(epochs=2, val_batch_size=50)


class _Record(pl.Callback):
    """The dataset indices of every batch each rank ran, per epoch (batches carry their indices third)."""

    def __init__(self) -> None:
        self.train: dict[int, list[list[int]]] = {}
        self.val: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, _: int) -> None:
        self.train.setdefault(trainer.current_epoch, []).append(batch[2].tolist())

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, _: int, __: int = 0
    ) -> None:
        self.val.setdefault(trainer.current_epoch, []).extend(batch[2].tolist())


def _indexed(dataset: TensorDataset) -> TensorDataset:
    images, labels = dataset.tensors
    return TensorDataset(images, labels, torch.arange(len(labels)))


def _fit(task: str, devices: int) -> dict[str, Any]:
    """Fit ``task``'s digits module with loaders whose batches carry their indices; what each rank saw."""
    module = digits_module(task, CONFIG)  # type: ignore[arg-type]
    train, val = module.loaders_train, module.loaders_val
    assert isinstance(train, DataLoader)
    assert isinstance(val, DataLoader)
    module.loaders_train = DataLoader(_indexed(train.dataset), batch_sampler=train.batch_sampler)  # type: ignore[arg-type]
    module.loaders_val = DataLoader(_indexed(val.dataset), batch_size=val.batch_size)  # type: ignore[arg-type]
    record = _Record()
    trainer = digits_trainer(devices, CONFIG.epochs, callbacks=[record])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on loader workers and deprecations
        trainer.fit(module)
    model = module.extractor if task == "extractor" else module.pairwise_model
    assert model is not None
    return {
        "train": record.train,
        "val": record.val,
        "metrics": dict(module.validation_metrics),
        "logged": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "weights": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "base_seed": getattr(module.patched_train_loaders[0].batch_sampler, "base_seed", None),
    }


def _expected_epochs(train_labels: torch.Tensor, base_seed: int) -> list[list[list[int]]]:
    """Each epoch's batches of the P x K sampler as one process draws them: a one-rank wrapper with the same
    base seed (the ranks share rank 0's)."""
    sampler = BalancedBatchSampler(train_labels, CONFIG.classes_per_batch, CONFIG.samples_per_class)
    wrapper = DDPSamplerWrapper(sampler, shuffle_samples_between_gpus=False)
    wrapper.base_seed = base_seed
    return [list(wrapper) for _ in range(CONFIG.epochs)]


def _check_sharding(ranks: list[dict[str, Any]]) -> None:
    train, val = digits_datasets(seed=CONFIG.seed)
    assert ranks[0]["base_seed"] == ranks[1]["base_seed"] is not None
    for epoch, batches in enumerate(_expected_epochs(train.tensors[1], ranks[0]["base_seed"])):
        assert len(batches) % 2 == 0  # 44 batches: no padding, so each batch is run exactly once
        assert [r["train"][epoch] for r in ranks] == [batches[0::2], batches[1::2]], f"epoch {epoch}"
    n = len(val)  # 359: odd, so the last rank's shard is padded with one duplicate
    for epoch in range(CONFIG.epochs):
        seen = [r["val"][epoch] for r in ranks]
        assert [len(s) for s in seen] == [(n + 1) // 2] * 2
        assert sorted(seen[0] + seen[1]) == sorted([*range(n), 0])


@pytest.mark.timeout(240)
def test_extractor_module_shards_the_batch_sampler_and_logs_exact_precision_at_1() -> None:
    ranks = run_parallel(_fit, "extractor", 2, world_size=2, timeout=180)
    assert [(r["world_size"], r["strategy"]) for r in ranks] == [(2, "DDPStrategy")] * 2
    _check_sharding(ranks)
    weights = ranks[0]["weights"]
    assert all(torch.equal(weights[k], ranks[1]["weights"][k]) for k in weights), "DDP kept the ranks in step"
    # A single-process evaluation of the final weights over the whole validation split.
    _, val = digits_datasets(seed=CONFIG.seed)
    extractor = EmbeddingNet()
    extractor.load_state_dict(weights)
    with torch.no_grad():
        expected = precision_at_1(extractor(val.tensors[0]), val.tensors[1])
    assert [r["metrics"]["precision_at_1"] for r in ranks] == [expected, expected]
    assert [r["logged"]["precision_at_1"] for r in ranks] == [float(torch.tensor(expected))] * 2
    assert expected > 0.9, "the extractor learned"


def _rerank_one_process(scorer: PairwiseScorer, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """Correct top-1 answers before and after re-ranking, one query at a time."""
    before = after = 0
    for query in range(len(labels)):
        gaps = distances(embeddings[query : query + 1], embeddings)[0]
        gaps[query] = float("inf")
        candidates = gaps.topk(CONFIG.top_n, largest=False).indices
        with torch.no_grad():
            scores = scorer(embeddings[query].expand(CONFIG.top_n, -1), embeddings[candidates])
        before += int(labels[candidates[0]] == labels[query])
        after += int(labels[candidates[scores.argmax()]] == labels[query])
    return before, after


@pytest.mark.timeout(240)
def test_pairwise_module_reports_exact_precision_before_and_after_reranking() -> None:
    ranks = run_parallel(_fit, "pairwise", 2, world_size=2, timeout=180)
    _check_sharding(ranks)
    _, val = digits_datasets(seed=CONFIG.seed)
    scorer = PairwiseScorer(dim=64)
    scorer.load_state_dict(ranks[0]["weights"])
    before, after = _rerank_one_process(scorer, val.tensors[0], val.tensors[1])
    n = len(val)
    expected = {"precision_at_1_before": before / n, "precision_at_1_after": after / n}
    assert [r["metrics"] for r in ranks] == [expected, expected]
    for name, value in expected.items():
        assert [r["logged"][name] for r in ranks] == [float(torch.tensor(value))] * 2


# --- OML's signatures and dict batches ----------------------------------------------------------------


class _AllPairsMiner:
    """OML's ``PairsMiner`` interface: ``sample(features, labels) -> (ids1, ids2, is_negative)``."""

    def sample(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids1, ids2 = torch.triu_indices(len(labels), len(labels), 1)
        return ids1, ids2, labels[ids1] != labels[ids2]


class _GapModel(torch.nn.Module):
    """OML's pairwise model interface, ``forward(x1, x2)``: a learned "is negative" score of two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = torch.nn.Parameter(torch.ones(64))
        self.bias = torch.nn.Parameter(torch.zeros(()))

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return ((x1 - x2).pow(2) * self.weights).sum(-1) - self.bias - 4.0


class _DictDigits(torch.utils.data.Dataset[dict[str, Any]]):
    """OML-style items: inputs, labels and pre-computed embeddings (here the pixels themselves)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.images, self.labels = dataset.tensors

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = self.images[index]
        return {"input_tensors": image, "labels": self.labels[index], "embeddings": image, "index": index}


def _oml_pairwise_module() -> PairwiseModuleDDP:
    train, val = digits_datasets(seed=0)
    train_loader = DataLoader(_DictDigits(train), batch_sampler=BalancedBatchSampler(train.tensors[1], 4, 4))
    model = _GapModel()
    return PairwiseModuleDDP(
        train_loader, DataLoader(_DictDigits(val), batch_size=64), model, _AllPairsMiner(), None,
        torch.optim.SGD(model.parameters(), lr=0.01), top_n=3,
    )  # fmt: skip


def _fit_oml_pairwise() -> dict[str, Any]:
    torch.manual_seed(0)
    module = _oml_pairwise_module()
    trainer = digits_trainer(2, 1, limit_train_batches=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module)
    return {"metrics": module.validation_metrics, "weights": dict(module.model.state_dict())}


@pytest.mark.timeout(240)
def test_omls_pairwise_module_with_a_pairs_miner_on_two_ranks_equals_one_process() -> None:
    """OML's way: a miner on the embeddings, the model scoring inputs (x1=, x2=), criterion(pred, is_negative)."""
    ranks = run_parallel(_fit_oml_pairwise, world_size=2, timeout=180)
    module = _oml_pairwise_module()
    module.model.load_state_dict(ranks[0]["weights"])
    _, val = digits_datasets(seed=0)
    images, labels = val.tensors
    expected = module.split_metrics(images, labels, images)  # one process: every query here
    assert [r["metrics"] for r in ranks] == [expected, expected]
    assert expected["precision_at_1_before"] > 0.9
