"""``launch`` and ``run_script``, at the path of earlier ddpkit versions (they live in :mod:`ddpkit.jobs.launch`)."""

from __future__ import annotations

from ddpkit.jobs.launch import StartMethod, check_target, launch, run_script, scheduler_environment

__all__ = ["StartMethod", "check_target", "launch", "run_script", "scheduler_environment"]
