"""``predict_in_order`` and ``sharded_for_evaluation``, at the path of earlier ddpkit versions (they live in
:mod:`ddpkit.training`)."""

from __future__ import annotations

from ddpkit.training._evaluation import PredictStep, predict_in_order
from ddpkit.training._sources import sharded_for_evaluation

__all__ = ["PredictStep", "predict_in_order", "sharded_for_evaluation"]
