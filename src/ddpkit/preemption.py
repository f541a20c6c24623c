"""``Preempted`` and ``PreemptionHandler``, at the path of earlier ddpkit versions (they live in
:mod:`ddpkit.training._preemption`)."""

from __future__ import annotations

from ddpkit.training._preemption import Preempted, PreemptionHandler

__all__ = ["Preempted", "PreemptionHandler"]
