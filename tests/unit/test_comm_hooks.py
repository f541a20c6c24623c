"""Lightning's register_ddp_comm_hook: its docstring's examples, every name, gradients, errors at registration.

Here, the tests that need no process; the others are in tests/ranks/test_comm_hooks.py.
"""

from __future__ import annotations

import pytest
from torch import nn

from ddpkit import register_ddp_comm_hook


def test_no_hook_registers_nothing_even_on_a_model_without_ddp_and_a_wrapper_alone_is_refused() -> None:
    """Lightning calls it with ``ddp_comm_hook=None`` on every model: nothing happens, even to a model DDP does not
    wrap (a hook there raises ``TypeError``); a wrapper without a hook to wrap is refused, naming the fix."""

    model = nn.Linear(1, 1)
    before = dict(vars(model))
    assert register_ddp_comm_hook(model, None, None) is None  # type: ignore[arg-type]
    assert vars(model) == before
    with pytest.raises(TypeError, match="needs a DistributedDataParallel model, got Linear"):
        register_ddp_comm_hook(model, ddp_comm_hook="allreduce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ddp_comm_wrapper wraps a hook: pass ddp_comm_hook too"):
        register_ddp_comm_hook(model, None, None, ddp_comm_wrapper="fp16")  # type: ignore[arg-type]
