"""Lightning's gather_all_tensors, all_gather_ddp_if_available and AllGatherGrad.

Here, the tests that need no process; the others are in tests/ranks/test_gather.py.
"""

from __future__ import annotations

import torch

from ddpkit import all_gather_ddp_if_available, gather_all_tensors


def test_without_a_process_group_the_tensor_comes_back_as_it_is() -> None:
    """Lightning's ``all_gather_ddp_if_available`` returns its input when nothing is distributed."""
    tensor = torch.arange(3.0, requires_grad=True)
    (only,) = gather_all_tensors(tensor)
    assert only is tensor
    assert all_gather_ddp_if_available(tensor) is tensor
    with_grad = all_gather_ddp_if_available(tensor, sync_grads=True)
    with_grad.sum().backward()
    assert tensor.grad is not None
    assert tensor.grad.tolist() == [1.0, 1.0, 1.0]
