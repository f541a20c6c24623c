"""A model's gradients, one flat tensor per device and dtype, reduced by one collective each and copied back."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def reduce_gradients(parameters: Iterable[nn.Parameter], reduce: Callable[[torch.Tensor], bool]) -> None:
    """Hand the gradients of ``parameters`` to ``reduce`` as one flat tensor per device and dtype, and copy
    what it leaves in the tensor back into the gradients.

    A parameter that requires a gradient but has none gets zeros (so a rank with no batch in a step
    takes part). ``reduce`` changes the flat tensor in place and returns ``False`` to stop: that tensor
    is not copied back and the rest are not reduced.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.requires_grad:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            groups.setdefault((parameter.grad.device, parameter.grad.dtype), []).append(parameter.grad)
    for grads in groups.values():
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        if not reduce(flat):
            return
        for grad, part in zip(grads, torch.split(flat, [grad.numel() for grad in grads]), strict=True):
            grad.copy_(part.view_as(grad))
