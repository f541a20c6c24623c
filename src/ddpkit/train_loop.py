"""``TrainLoop``, at the path of earlier ddpkit versions (it lives in :mod:`ddpkit.training`)."""

from __future__ import annotations

from ddpkit.training._loop import TrainLoop

__all__ = ["TrainLoop"]
