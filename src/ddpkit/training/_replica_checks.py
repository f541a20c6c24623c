"""What replica groups keep equal besides the weights' gradients (private): the numeric buffers they average each
step, and the weights' norms they compare after a commit."""

from __future__ import annotations

import torch

from ddpkit._torch_private import private

__all__ = ["numeric_buffers", "weight_norms"]


def numeric_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's numeric buffers (BatchNorm's running statistics and batch count): what the groups average
    each step (integer ones rounded), so that every group has the same."""
    return [buffer for buffer in model.buffers() if buffer.dtype != torch.bool and not buffer.is_complex()]


def weight_norms(model: torch.nn.Module) -> list[float]:
    """The L1 norm and the squared L2 norm of ``model``'s parameters (each parameter's norms in its dtype, summed in
    float64; both orders' norms in one ``stack`` per device, read back once)."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in model.parameters():
        per_device.setdefault(parameter.device, []).append(parameter.detach())
    l1 = l2 = 0.0
    foreach_norm = private("foreach_norm")
    with torch.no_grad():
        for tensors in per_device.values():
            count = len(tensors)
            norms = torch.stack([*foreach_norm(tensors, 1), *foreach_norm(tensors, 2)]).double()
            sums = torch.stack([norms[:count].sum(), norms[count:].square().sum()]).tolist()
            l1, l2 = l1 + sums[0], l2 + sums[1]
    return [l1, l2]
