"""Lightning's register_ddp_comm_hook: its docstring's examples, every name, gradients, errors at registration.

Here, the tests that need no process; the others are in tests/ranks/test_comm_hooks.py.
"""

from __future__ import annotations

from torch import nn

from ddpkit import register_ddp_comm_hook


def test_no_hook_registers_nothing() -> None:
    register_ddp_comm_hook(nn.Linear(1, 1), None, None)  # type: ignore[arg-type]
