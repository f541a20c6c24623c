"""What ``TrainLoop.fit_distributed``'s launchers take (:class:`Fits`) and give back (:data:`Result`)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ddpkit.callbacks import Callback
from ddpkit.training._state import RunState

__all__ = ["Fits", "Result"]

#: What a launcher hands back: rank 0's (or the first replica group's) weights, ``None`` on a node without
#: rank 0, and its run state.
Result = tuple[dict[str, torch.Tensor] | None, RunState]


class Fits(Protocol):
    """What the launchers need of a ``TrainLoop``: its model, run state, fault-tolerance settings and ``fit``."""

    model: nn.Module
    state: RunState
    ddp_handler: Any
    fault_tolerance: Any

    def fit(
        self, num_epochs: int, grad_accumulation: int = 1, callbacks: list[Callback] | None = None
    ) -> dict[str, list[float]]: ...
