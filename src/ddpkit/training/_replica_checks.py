"""What replica groups keep equal besides the weights' gradients (private): the numeric buffers they average each
step, and the weights' norms they compare after a commit."""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

import torch

from ddpkit._gradients import local_tensor
from ddpkit._torch_private import private
from ddpkit.errors import DDPKitError

__all__ = ["check_same_weights", "numeric_buffers", "weight_norms"]


def numeric_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's numeric buffers (BatchNorm's running statistics and batch count): what the groups average
    each step (integer ones rounded), so that every group has the same."""
    return [buffer for buffer in model.buffers() if buffer.dtype != torch.bool and not buffer.is_complex()]


def weight_norms(parameters: Iterable[torch.Tensor]) -> list[float]:
    """The L1 norm and the squared L2 norm of ``parameters`` (a model's; each parameter's norms in its dtype, read
    back in one ``stack`` per device and summed in float64 on the host). A sharded parameter counts as its local
    shard: compared with the same rank of the other replica groups, which holds the same shard."""
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for parameter in parameters:
        local = local_tensor(parameter)  # no graph: the norms are taken under no_grad
        per_device.setdefault(local.device, []).append(local)
    l1 = l2 = 0.0
    foreach_norm = private("foreach_norm")
    with torch.no_grad():
        for tensors in per_device.values():
            norms = torch.stack(foreach_norm(tensors, 1) + foreach_norm(tensors, 2)).tolist()
            l1 += math.fsum(norms[: len(tensors)])
            l2 += math.fsum(norm * norm for norm in norms[len(tensors) :])
    return [l1, l2]


def check_same_weights(replica_id: str, own: list[float], mean: list[float], step: int) -> None:
    """Raise when replica group ``replica_id``'s weights are not the quorum's at ``step``: ``own`` (the L1 norm and
    squared L2 norm of this rank's parameters, or of its shards) against their ``mean`` over the same rank of the
    participants (float32 after the all-reduce).

    Raises:
        DDPKitError: they differ by more than 1e-5 (relative); every group of the quorum raises.
    """
    means = mean
    own32 = array("f", own).tolist()  # as the all-reduce carried them (float32)
    if all(abs(m - o) <= 1e-5 * max(abs(o), 1.0) for m, o in zip(means, own32, strict=True)):
        return
    raise DDPKitError(
        f"replica group {replica_id}: its weights are not the other groups' at step {step} (L1 "
        f"norm {own[0]:.8g} and squared L2 norm {own[1]:.8g}; their mean over the quorum "
        f"{means[0]:.8g} and {means[1]:.8g}): the groups no longer train one model and the result "
        "would not be that of one process, so every group stops here. Restart the job from its last "
        "checkpoint, and please report this as a bug of ddpkit's fault tolerance"
    )
