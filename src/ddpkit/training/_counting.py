"""What a batch counts: its tokens (the loop's ``tokens_fn``), and a batch that counts nothing (private)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["CountsNothing", "tokens_of"]


def tokens_of(count: Callable[[Any], int | torch.Tensor], data: Any, weight: float) -> float | torch.Tensor:
    """The tokens of a batch (``data``, on the device) by the loop's ``tokens_fn``, times its ``weight`` (0 for
    padding): a float, or a float64 tensor left on its device.

    Raises:
        TypeError: ``tokens_fn`` returned something else than a number or a one-element tensor.
    """
    tokens = count(data)
    if isinstance(tokens, torch.Tensor) and tokens.numel() == 1:
        tokens = tokens.detach().double().reshape(())
        return tokens if weight == 1.0 else tokens * weight
    if isinstance(tokens, (int, float)) and not isinstance(tokens, bool):
        return float(tokens) * weight
    raise TypeError(
        f"tokens_fn returned {type(tokens).__name__} {tokens!r:.80}: it must return a batch's number of tokens, an int "
        "or a one-element tensor (batch['attention_mask'].sum(), say)"
    )


class CountsNothing:
    """Around a batch that counts nothing: keeps the outputs of ``forward_model``'s calls (its backward starts from
    them) and ``model``'s buffers as they were, put back on leaving."""

    def __init__(self, forward_model: nn.Module, model: nn.Module) -> None:
        self.forward_model, self.model = forward_model, model
        self.outputs: list[Any] = []

    def __enter__(self) -> CountsNothing:
        self.buffers = [(buffer, buffer.detach().clone()) for buffer in self.model.buffers()]
        self.kept = self.forward_model.register_forward_hook(lambda module, inputs, output: self.outputs.append(output))
        return self

    def __exit__(self, *exc: object) -> None:
        self.kept.remove()
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
