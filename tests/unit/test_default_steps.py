"""TrainLoop's default steps: dict batches as keyword arguments, an output's own loss and logits (transformers'
``ModelOutput``), per-token scores, the language-model metrics, and the errors of steps that return something else.

Here, the tests in one process; tests/ranks/test_hf_models.py runs transformers models on several ranks.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from ddpkit import TrainLoop
from ddpkit.training._default_steps import language_model_metrics, language_model_rows

VOCAB, LENGTH = 11, 6


class TinyLM(nn.Module):
    """A per-token model: ``(N, T)`` token ids to ``(N, T, V)`` scores; with ``own_loss``, a dict with ``logits``
    and the loss of its ``labels`` (shifted, as transformers' causal models; not, as a token classifier)."""

    def __init__(self, own_loss: bool = False, shift: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)
        self.own_loss, self.shift = own_loss, shift

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        if not self.own_loss:
            return logits
        loss = None
        if labels is not None:
            scores, targets = (logits[:, :-1], labels[:, 1:]) if self.shift else (logits, labels)
            loss = nn.functional.cross_entropy(scores.flatten(0, 1), targets.flatten())
        return {"loss": loss, "logits": logits}


def _sequences(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))


def _dict_items(n: int, ignore_first: bool = False) -> list[dict[str, torch.Tensor]]:
    items = []
    for sequence in _sequences(n):
        labels = sequence.clone()
        if ignore_first:
            labels[:2] = -100  # a prompt that counts in no loss
        items.append({"input_ids": sequence, "labels": labels})
    return items


def _hand_metrics(model: nn.Module, logits_of: Any, labels: torch.Tensor, shift: bool) -> dict[str, float]:
    with torch.no_grad():
        logits = logits_of(model)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    counted = labels != -100
    nll = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100)
    tokens = int(counted.sum())
    correct = int(((logits.argmax(-1) == labels) & counted).sum())
    loss = float(nll) / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "token_accuracy": correct / tokens}


def test_a_dict_batch_goes_in_as_keyword_arguments_and_the_models_own_loss_trains() -> None:
    model = TinyLM(own_loss=True)
    items = _dict_items(12)
    loop = TrainLoop(model, DataLoader(items, batch_size=4), optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                     progress=False)  # fmt: skip
    loop.fit(1)
    by_hand = TinyLM(own_loss=True)
    optimizer = torch.optim.SGD(by_hand.parameters(), lr=0.5)
    for batch in DataLoader(items, batch_size=4):
        by_hand(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters(), strict=True))
    assert not torch.equal(model.head.weight, TinyLM().head.weight), "it trained"


def test_a_criterion_given_beside_a_models_own_loss_is_said_once_to_be_unused(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyLM(own_loss=True)
    loop = TrainLoop(model, DataLoader(_dict_items(12), batch_size=4), criterion=nn.MSELoss(), progress=False)
    with caplog.at_level(logging.WARNING, logger="ddpkit"):
        loop.fit(1)
    said = [r.getMessage() for r in caplog.records if "is not used" in r.getMessage()]
    assert len(said) == 1, said
    assert "criterion=MSELoss() is not used: the model's output has a loss of its own" in said[0]


def test_per_token_scores_train_with_the_default_criterion_and_evaluate_as_language_model_metrics() -> None:
    """``(inputs, targets)`` pairs whose targets line up with the positions (already shifted, as a byte LM's)."""
    sequences = _sequences(20)
    pairs = list(zip(sequences, sequences.roll(-1, dims=1), strict=True))
    model = TinyLM()
    loop = TrainLoop(model, DataLoader(pairs[:12], batch_size=4), DataLoader(pairs[12:], batch_size=3),
                     progress=False)  # fmt: skip
    history = loop.fit(1)
    inputs, targets = (torch.stack(part) for part in zip(*pairs[12:], strict=True))
    expected = _hand_metrics(model, lambda m: m(inputs), targets, shift=False)
    assert history["validation_loss"][0] == pytest.approx(expected["loss"], rel=1e-6)
    assert history["validation_perplexity"][0] == pytest.approx(expected["perplexity"], rel=1e-6)
    assert history["validation_token_accuracy"][0] == expected["token_accuracy"]
    assert "validation_accuracy" not in history


@pytest.mark.parametrize("shift", [True, False], ids=["causal", "token-classifier"])
def test_which_token_a_position_scores_is_read_from_the_models_own_loss(shift: bool) -> None:
    model = TinyLM(own_loss=True, shift=shift)
    items = _dict_items(10, ignore_first=True)
    loop = TrainLoop(model, DataLoader(items[:4], batch_size=4), DataLoader(items, batch_size=3), progress=False)
    metrics = loop.evaluate(loop.validation_loader)
    labels = torch.stack([item["labels"] for item in items])
    inputs = torch.stack([item["input_ids"] for item in items])
    expected = _hand_metrics(model, lambda m: m(inputs)["logits"], labels, shift=shift)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert metrics["token_accuracy"] == expected["token_accuracy"]
    wrong = _hand_metrics(model, lambda m: m(inputs)["logits"], labels, shift=not shift)
    assert abs(wrong["loss"] - expected["loss"]) > 1e-3, "the two readings differ: the test can tell them apart"


def test_what_evaluation_gathers_of_a_language_model_is_three_numbers_a_sequence() -> None:
    model = TinyLM(own_loss=True)
    loop = TrainLoop(model, DataLoader(_dict_items(4), batch_size=4), progress=False)
    predictions, targets = loop.predict_step(model, next(iter(DataLoader(_dict_items(5), batch_size=5))))
    assert predictions.shape == (5, 3)
    assert predictions.dtype == torch.float64
    assert torch.equal(targets, torch.full((5,), LENGTH - 1.0, dtype=torch.float64)), "tokens a sequence, shifted"


def test_the_language_model_rows_leave_out_ignored_labels_and_sum_to_the_mean_loss() -> None:
    logits = torch.randn(3, 5, VOCAB, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2))
    labels[0] = -100  # a sequence with no token that counts
    labels[1, :2] = -100
    rows = language_model_rows(logits, labels)
    assert rows[:, 1].tolist() == [0.0, 3.0, 5.0]
    assert rows[0].tolist() == [0.0, 0.0, 0.0]
    mean = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert language_model_metrics(rows)["loss"] == pytest.approx(float(mean), rel=1e-6)
    assert math.isnan(language_model_metrics(rows[:1])["loss"]), "no token: nan, not a division by zero"


def test_a_model_whose_own_loss_fits_neither_reading_is_refused_with_the_fix() -> None:
    class Odd(TinyLM):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            out = super().forward(input_ids, labels)
            return {"loss": out["loss"] * 3.0, "logits": out["logits"]}

    model = Odd(own_loss=True)
    loop = TrainLoop(model, DataLoader(_dict_items(4), batch_size=4), DataLoader(_dict_items(4), batch_size=2),
                     progress=False)  # fmt: skip
    with pytest.raises(ValueError, match=r"neither the next-token loss .* override predict_step and compute_metrics"):
        loop.evaluate(loop.validation_loader)


class _Returns(TrainLoop):
    """A loop whose training_step returns ``what(loss)``."""

    what: Any = staticmethod(lambda loss: loss)

    def training_step(self, model: nn.Module, batch: Any) -> Any:
        inputs, targets = batch
        losses = nn.functional.cross_entropy(model(inputs), targets, reduction="none")
        return type(self).what(losses)


def _pairs(n: int = 8) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(0)
    return DataLoader(list(zip(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator),
                               strict=True)), batch_size=4)  # fmt: skip


@pytest.mark.parametrize(
    ("what", "message"),
    [
        (lambda losses: losses, r"_Returns\.training_step \(.*test_default_steps\.py:\d+\) returned a tensor of shape "
                                r"\(4,\), not a scalar loss: return its mean over the batch \(\.mean\(\)\)"),
        (lambda losses: {"logits": losses}, r"returned a dict, not the loss: return a scalar tensor"),
        (lambda losses: float(losses.mean()), r"returned a float, not the loss"),
    ],
    ids=["per-sample losses", "a dict without a loss", "a float"],
)  # fmt: skip
def test_a_training_step_that_returns_no_scalar_loss_is_named_with_the_fix(what: Any, message: str) -> None:
    model = nn.Linear(4, 3)

    class Loop(_Returns):
        pass

    Loop.what = staticmethod(what)
    Loop.__name__ = "_Returns"
    with pytest.raises(TypeError, match=message):
        Loop(model, _pairs(), progress=False).fit(1)


def test_a_training_step_may_return_an_output_with_a_loss_as_lightning_takes_a_dict() -> None:
    class Loop(_Returns):
        what = staticmethod(lambda losses: {"loss": losses.mean(), "logits": None})

    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    history = Loop(model, _pairs(), progress=False).fit(1)
    assert not torch.equal(model.weight, before)
    assert math.isfinite(history["train_loss"][0])


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (torch.zeros(2, 4), r"training_step: the default step takes a batch \(inputs, targets\), or a mapping .* not "
                            r"a tensor of shape \(2, 4\): override training_step"),
        ((torch.zeros(2, 4), torch.zeros(2), torch.zeros(2)), r"not a tuple of 3 \(a tensor of shape \(2, 4\), "),
    ],
    ids=["a tensor", "a triple"],
)  # fmt: skip
def test_a_batch_the_default_step_cannot_read_is_named_with_the_fix(batch: Any, message: str) -> None:
    model = nn.Linear(4, 3)
    loop = TrainLoop(model, _pairs(), progress=False)
    with pytest.raises(TypeError, match=message):
        loop.training_step(model, batch)


def test_outputs_and_settings_the_default_steps_cannot_use_are_named_with_the_fix() -> None:
    class Words(nn.Linear):
        def forward(self, x: torch.Tensor) -> str:  # type: ignore[override]
            return "no tensor"

    loop = TrainLoop(Words(4, 3), _pairs(), progress=False)
    with pytest.raises(TypeError, match=r"predict_step: the model returned a str, neither a tensor nor an output "
                                        r"with 'logits' .*: override predict_step"):  # fmt: skip
        loop.predict_step(loop.model, (torch.zeros(2, 4), torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"metrics='perplexity': use one of 'classification', 'lm' or None"):
        TrainLoop(nn.Linear(4, 3), _pairs(), metrics="perplexity")  # type: ignore[arg-type]
    classifier = TrainLoop(nn.Linear(4, 3), _pairs(), metrics="lm", progress=False)
    wrong_kind = r"metrics='lm' takes per-token scores \(N, T, V\) .* not predictions of shape \(4, 3\) with targets"
    with pytest.raises(TypeError, match=wrong_kind + r" \(4,\): pass metrics='classification'"):
        classifier.evaluate(_pairs())


def test_a_predict_step_that_returns_no_pair_of_tensors_is_named() -> None:
    class Loop(TrainLoop):
        def predict_step(self, model: nn.Module, batch: Any) -> Any:
            return model(batch[0])

    loop = Loop(nn.Linear(4, 3), _pairs(), progress=False)
    with pytest.raises(TypeError, match=r"Loop\.predict_step \(.*\) returned a tensor of shape \(4, 3\), not "
                                        r"\(predictions, targets\)"):  # fmt: skip
        loop.evaluate(_pairs())
