"""What ``TrainLoop``'s default steps make of a batch and of what the model returns, and the metrics they report.

A batch is ``(inputs, targets)`` (``model(inputs)``) or a mapping of the
model's keyword arguments (``model(**batch)``, transformers' convention, its
targets under ``"labels"``). The model returns a tensor, or an output with a
``loss`` and ``logits`` (transformers' ``ModelOutput``, or a dict): the loss
is the model's own when it has one, else the criterion's; the prediction is
the logits. Per-token scores (``(N, T, V)`` with ``(N, T)`` integer labels, a
language model's) are evaluated as three numbers a sequence (its summed
negative log-likelihood, its tokens, its correct tokens), never gathered as
logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from ddpkit.batches import move_data_to_device
from ddpkit.process_group import get_rank

__all__ = [
    "IGNORE_INDEX",
    "DefaultSteps",
    "MetricSet",
    "StepMethods",
    "language_model_metrics",
    "language_model_rows",
    "returned_loss",
    "returned_prediction",
]

log = logging.getLogger("ddpkit.training")

#: What ``TrainLoop(metrics=...)`` takes: ``None`` picks by the model's output.
MetricSet = Literal["classification", "lm"] | None
_METRIC_SETS = ("classification", "lm")

#: The label of a token that counts in no loss or metric (torch's ``cross_entropy`` default, transformers' padding).
IGNORE_INDEX = -100


class DefaultSteps:
    """The default ``training_step``, ``predict_step`` and ``compute_metrics`` of one loop, and what they learned
    of its model (which metric set; whether its labels are shifted by one, as a causal language model's are)."""

    def __init__(self, criterion_given: bool, metrics: MetricSet) -> None:
        if metrics not in (None, *_METRIC_SETS):
            raise ValueError(f"metrics={metrics!r}: use one of {', '.join(map(repr, _METRIC_SETS))} or None (picked "
                             "by the model's output: per-token scores give 'lm')")  # fmt: skip
        self.criterion_given, self.metrics = criterion_given, metrics
        self.kind: str | None = metrics  # the metric set, once a prediction has said which (with None)
        self.shift: bool | None = None  # the labels are the inputs, each token predicting the next
        self._said_criterion_unused = False

    # --- training ------------------------------------------------------------------------------------

    def loss(self, model: nn.Module, batch: Any, criterion: nn.Module) -> torch.Tensor:
        """The default ``training_step``: the model's own loss, or the criterion's of its prediction."""
        output, targets = _forward(model, batch, "training_step")
        own = _field(output, "loss")
        if isinstance(own, torch.Tensor):
            if self.criterion_given and not self._said_criterion_unused:
                self._said_criterion_unused = True
                if get_rank() == 0:
                    log.warning(
                        "criterion=%r is not used: the model's output has a loss of its own (the default "
                        "training_step returns it); pass no criterion, or override training_step to use it",
                        criterion,
                    )
            return own
        if targets is None:
            raise TypeError(
                f"training_step: the batch has no 'labels' and the model returned {_describe(output)} without a "
                "loss: put the targets under 'labels' (the model then computes its loss, as transformers' do), or "
                "override training_step"
            )
        return criterion_loss(criterion, _prediction(output, "training_step"), targets)

    # --- evaluation ----------------------------------------------------------------------------------

    def predict(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The default ``predict_step``: ``(predictions, targets)``, one row per sample (for per-token scores,
        :func:`language_model_rows` and the sequences' token counts)."""
        output, targets = _forward(model, batch, "predict_step")
        prediction = _prediction(output, "predict_step")
        if targets is None:
            raise TypeError(
                "predict_step: the batch has no 'labels' (the targets to evaluate against): put them under "
                "'labels', or override predict_step to return (predictions, targets)"
            )
        if self.kind is None:
            self.kind = "lm" if _per_token(prediction, targets) else "classification"
        if self.kind == "classification":
            return prediction, targets
        if not _per_token(prediction, targets):
            raise TypeError(
                f"metrics='lm' takes per-token scores (N, T, V) and integer labels (N, T), not predictions of shape "
                f"{tuple(prediction.shape)} with targets {tuple(targets.shape)}: pass metrics='classification', or "
                "override predict_step"
            )
        if self.shift is None:
            self.shift = _shifted(prediction, targets, _field(output, "loss"), isinstance(batch, Mapping))
        rows = language_model_rows(prediction, targets, shift=self.shift)
        return rows, rows[:, 1]

    def compute(self, predictions: torch.Tensor, targets: torch.Tensor, criterion: nn.Module) -> dict[str, float]:
        """The default ``compute_metrics``."""
        if self.kind == "lm":
            return language_model_metrics(predictions)
        metrics = {"loss": float(criterion_loss(criterion, predictions, targets))}
        if predictions.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point():
            metrics["accuracy"] = float((predictions.argmax(dim=1) == targets).double().mean())
        return metrics


def returned_loss(value: Any, where: Callable[[], str]) -> torch.Tensor:
    """The loss a ``training_step`` (``where()``: its name and place) returned: a tensor of one element, or an
    output's ``loss`` (a transformers ``ModelOutput``, a dict, as Lightning takes ``{"loss": ...}``)."""
    loss = value if isinstance(value, torch.Tensor) else _field(value, "loss")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"{where()} returned {_describe(value)}, not the loss: return a scalar tensor (for a transformers model, "
            "its output's .loss)"
        )
    if loss.numel() != 1:
        raise TypeError(
            f"{where()} returned {_describe(loss)}, not a scalar loss: return its mean over the batch (.mean())"
        )
    return loss


def returned_prediction(value: Any, where: Callable[[], str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(predictions, targets)`` a ``predict_step`` (``where()``) returned, checked."""
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(part, torch.Tensor) for part in value)
    ):
        raise TypeError(
            f"{where()} returned {_describe(value)}, not (predictions, targets), two tensors with a row per sample "
            "(for a transformers model: (output.logits, batch['labels']), or smaller rows of your own)"
        )
    return value[0], value[1]


def criterion_loss(criterion: nn.Module, prediction: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``criterion(prediction, targets)``; a ``CrossEntropyLoss`` of per-token scores ``(N, T, V)`` (which it takes
    as ``(N * T, V)``: its own layout wants the classes in dimension 1) is the mean over the tokens."""
    if isinstance(criterion, nn.CrossEntropyLoss) and _per_token(prediction, targets):
        return criterion(prediction.flatten(0, -2), targets.flatten())  # type: ignore[no-any-return]
    return criterion(prediction, targets)  # type: ignore[no-any-return]


def language_model_rows(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool = False) -> torch.Tensor:
    """Per sequence, ``(summed negative log-likelihood, tokens, correct tokens)``: float64, shape ``(N, 3)``.

    ``logits`` ``(N, T, V)`` score each position's token ``labels`` ``(N, T)``; with ``shift``, position ``t``
    scores ``labels[:, t + 1]`` (transformers' causal language models, whose labels are their inputs). Tokens
    labelled ``-100`` count in nothing. What evaluation gathers in place of the logits: 3 numbers a sequence."""
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    counted = labels != IGNORE_INDEX
    scores = logits.float()
    nll = nn.functional.cross_entropy(
        scores.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    correct = (scores.argmax(dim=-1) == labels) & counted
    return torch.stack((nll.double().sum(1), counted.sum(1).double(), correct.sum(1).double()), dim=1)


def language_model_metrics(rows: torch.Tensor) -> dict[str, float]:
    """``loss`` (mean negative log-likelihood a token, in nats), ``perplexity`` (``exp(loss)``) and
    ``token_accuracy`` over the rows of :func:`language_model_rows` of a whole split (``nan`` without a token)."""
    totals = rows.double().sum(0).tolist()
    nll, tokens, correct = totals[0], totals[1], totals[2]
    if not tokens:
        return {"loss": math.nan, "perplexity": math.nan, "token_accuracy": math.nan}
    loss = nll / tokens
    return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "token_accuracy": correct / tokens}


def _forward(model: nn.Module, batch: Any, step: str) -> tuple[Any, torch.Tensor | None]:
    """``(model's output, targets)`` of a batch ``(inputs, targets)`` or a mapping of keyword arguments."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return model(**batch), labels if isinstance(labels, torch.Tensor) else None
    if isinstance(batch, tuple | list) and len(batch) == 2:
        inputs, targets = batch
        return model(inputs), targets
    raise TypeError(
        f"{step}: the default step takes a batch (inputs, targets), or a mapping of the model's keyword arguments "
        f"(transformers' convention, the targets under 'labels'), not {_describe(batch)}: override {step} for "
        "batches of another form"
    )


def _prediction(output: Any, step: str) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = _field(output, "logits")
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError(
        f"{step}: the model returned {_describe(output)}, neither a tensor nor an output with 'logits' (as "
        f"transformers' ModelOutput): override {step} to say what the prediction is"
    )


def _field(output: Any, name: str) -> Any:
    """``output.name`` or ``output[name]`` (a ``ModelOutput`` has both; a dict the second), else ``None``."""
    if isinstance(output, torch.Tensor):
        return None
    found = getattr(output, name, None)
    if found is None and isinstance(output, Mapping):
        found = output.get(name)
    return found


def _per_token(prediction: torch.Tensor, targets: torch.Tensor) -> bool:
    """Scores ``(N, T, ..., V)`` of integer labels ``(N, T, ...)`` (a language model's), not torch's
    classes-first layout ``(N, V, T, ...)``."""
    return (
        prediction.dim() >= 3
        and targets.dim() == prediction.dim() - 1
        and not targets.is_floating_point()
        and prediction.shape[:-1] == targets.shape
        and prediction.shape[2:] != targets.shape[1:]
    )


def _shifted(logits: torch.Tensor, labels: torch.Tensor, loss: Any, mapping: bool) -> bool:
    """Whether position ``t`` scores ``labels[:, t + 1]``: the one of the two readings that gives the model's own
    loss, when it returned one; otherwise a mapping's ``labels`` are its inputs (transformers' causal models),
    while ``(inputs, targets)`` pairs each position with its target."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return mapping
    own = float(loss)
    readings = {}
    for shift in (True, False):
        totals = language_model_rows(logits, labels, shift=shift).sum(0)
        readings[shift] = float(totals[0] / totals[1]) if float(totals[1]) else math.nan
    for shift in (mapping, not mapping):
        if math.isclose(readings[shift], own, rel_tol=1e-3, abs_tol=1e-4):
            return shift
    raise ValueError(
        f"the model's own loss {own:.6g} is neither the next-token loss of its labels ({readings[True]:.6g}) nor "
        f"each position's ({readings[False]:.6g}): the language-model metrics cannot say which tokens the logits "
        "score; override predict_step and compute_metrics (or pass metrics='classification')"
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        parts = ", ".join(_describe(part) for part in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({parts})"
    return f"a {type(value).__name__}"


class StepMethods:
    """``TrainLoop``'s steps to override (its base): each batch's device, loss and prediction, and the split's
    metrics, by default :class:`DefaultSteps`'."""

    if TYPE_CHECKING:  # the loop's (not documented here: the loop documents them)
        device: torch.device
        criterion: nn.Module
        default_steps: DefaultSteps

    def batch_to_device(self, batch: Any) -> Any:
        """Move a batch to ``device`` (nested tensors; see :func:`~ddpkit.move_data_to_device`)."""
        return move_data_to_device(batch, self.device)

    def training_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The loss of one batch (a scalar tensor); ``model`` is the DDP-wrapped model.

        Default: the model's own loss when its output has one (``output.loss``,
        transformers' ``ModelOutput``), else ``criterion(prediction, targets)``
        (the prediction: the output, or its ``logits``); the model is called as
        ``model(inputs)`` for a batch ``(inputs, targets)``, ``model(**batch)``
        for a mapping (the targets under ``"labels"``).

        Raises:
            TypeError: a batch of another form, or an output with neither a loss nor a prediction: override
                this method.
        """
        return self.default_steps.loss(model, batch, self.criterion)

    def predict_step(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(predictions, targets)`` of one batch, one row per sample: every row is gathered on every rank, so
        keep rows small (reduce per-token results per sample here).

        Default: ``(prediction, targets)`` of the batch as :meth:`training_step`
        calls the model; with ``metrics="lm"`` (the default for per-token
        scores), each sequence's ``(summed negative log-likelihood, tokens,
        correct tokens)`` instead of its logits.
        """
        return self.default_steps.predict(model, batch)

    def compute_metrics(self, predictions: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        """Metrics from the predictions and targets of a whole split, in order (the same on every rank).

        Default: ``loss`` (the criterion), and ``accuracy`` for class scores ``(N, C)``
        with integer targets ``(N,)``; with ``metrics="lm"``, ``loss``, ``perplexity`` and ``token_accuracy``.
        """
        return self.default_steps.compute(predictions, targets, self.criterion)
