"""A model's gradients, one flat tensor per device and dtype, reduced by one collective each and copied back.

A sharded parameter's gradient (a ``DTensor``: FSDP's, already reduce-scattered over its mesh) is reduced as its
local shard: rank ``r`` of one replica group with rank ``r`` of the others, which hold the same shard."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ddpkit._torch_private import private


def reduce_gradients(
    parameters: Iterable[nn.Parameter], reduce: Callable[[torch.Tensor], bool], extra: torch.Tensor | None = None
) -> bool:
    """Hand the gradients of ``parameters`` to ``reduce`` as one flat tensor per device and dtype, and copy
    what it leaves in the tensor back into the gradients; whether every ``reduce`` went through.

    A parameter that requires a gradient but has none gets zeros (so a rank with no batch in a step
    takes part). ``reduce`` changes the flat tensor in place and returns ``False`` to stop: that tensor
    is not copied back and the rest are not reduced. ``extra`` (1-D, a few numbers such as loss sums)
    rides at the end of the first flat tensor, in its dtype, and gets what ``reduce`` left there (it is
    reduced alone when there are no gradients): one collective fewer. A ``DTensor`` gradient is reduced as its
    local shard (no collective of its mesh).
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for parameter in parameters:
        if parameter.requires_grad:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            grad = local_tensor(parameter.grad)
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
    riding = extra
    for grads in groups.values():
        parts = [grad.reshape(-1) for grad in grads]
        if riding is not None:
            parts.append(riding.to(grads[0].device, grads[0].dtype))
        flat = torch.cat(parts)
        if not reduce(flat):
            return False
        sizes = [grad.numel() for grad in grads]
        pieces = torch.split(flat, [*sizes, flat.numel() - sum(sizes)])
        private("foreach_copy_")(grads, [part.view_as(grad) for grad, part in zip(grads, pieces, strict=False)])
        if riding is not None:
            riding.copy_(pieces[-1])
            riding = None
    if riding is not None:
        return reduce(riding)
    return True


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s local part: its shard on this rank for a ``DTensor`` (a view that writes through), else
    ``tensor`` itself."""
    tensors = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor was made
    return tensor.to_local() if tensors is not None and isinstance(tensor, tensors.DTensor) else tensor
