"""Gather tensors whose shapes may differ between ranks, with or without gradients (Lightning's and torchmetrics')."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpkit._compat import override
from ddpkit.collectives._codec import dtype_name
from ddpkit.collectives._group_info import GroupInfo
from ddpkit.collectives._headers import Header, encode_header, error_header, tensor_head
from ddpkit.collectives._tensor_records import gather_tensor_records
from ddpkit.collectives._transport import exchange_headers, exchange_rest, read_records
from ddpkit.errors import CollectiveMismatchError
from ddpkit.process_group import collective_device, get_rank, is_distributed

__all__ = ["AllGatherGrad", "all_gather_ddp_if_available", "describe_tensor", "gather_all_tensors", "gather_tensors"]


def describe_tensor(header: Header) -> str:
    """``"float32 (4, 8)"`` for a tensor header."""
    return f"{header['dtype']} {tuple(header['shape'])}"


def gather_all_tensors(result: torch.Tensor, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Gather ``result`` from every rank onto every rank (Lightning's and torchmetrics' function); every rank calls it.

    Any dimension may differ between ranks; the number of dimensions and the
    dtype may not. Empty and 0-d tensors work. Only each rank's real elements
    travel (no padding on gloo): small tensors cost one collective (an
    ``all_gather``; on gloo an ``all_to_all``, which is faster there), larger
    ones one more step.

    Args:
        result: this rank's tensor, on any device.
        group: the process group; default the whole world.

    Returns:
        ``[tensor of rank 0, tensor of rank 1, ...]`` (``world_size`` entries, in
        group-rank order), each on ``result``'s device with its own rank's shape.
        This rank's entry is ``result`` itself, with its autograd graph (as
        torchmetrics' and Lightning's: ``torch.autograd.grad(out[rank].sum(), x)``
        works); the other ranks' entries carry no gradient. Without a process
        group: ``[result]``.

    Raises:
        CollectiveMismatchError: ranks passed different dtypes or numbers of
            dimensions; raised on every rank, naming each rank's dtype and shape
            (``"rank 0: float32 (4, 8); rank 1: float32 (4,)"``).
        TypeError: some rank passed something that is not a tensor.
    """
    return _gather(result, group, "gather_all_tensors", same_shape=False)


def gather_tensors(
    result: Any, group: dist.ProcessGroup | None, what: str, same_shape: bool, check: Any = None
) -> list[torch.Tensor]:
    """:func:`gather_all_tensors` for ``what`` (the caller's name in messages): every rank's tensor, in rank order.
    ``check`` (default: the dtype, and the shape with ``same_shape`` or else the number of dimensions) gets every
    rank's header when the fast ending could not take the call; it is not called when every rank sent a small
    tensor of this one's dtype and number of dimensions (``same_shape``: and shape)."""
    return _gather(result, group, what, same_shape, check)


def _gather(
    result: Any, group: dist.ProcessGroup | None, what: str, same_shape: bool, given_check: Any = None
) -> list[torch.Tensor]:
    header: Header | None = None  # the dict form, built only when the fast path below cannot take this call
    if isinstance(result, torch.Tensor) and result.layout == torch.strided:
        payload: torch.Tensor | None = result
        head = tensor_head(result)
    else:
        payload, head = None, None
        if isinstance(result, torch.Tensor):
            header = error_header(TypeError(f"{what} needs a dense tensor, got a {result.layout} one"))
        else:
            header = error_header(TypeError(f"{what} needs a tensor, got {type(result).__name__}"))

    def check(headers: list[Header]) -> None:
        first = headers[0]
        for h in headers:
            shape_differs = h["shape"] != first["shape"] if same_shape else len(h["shape"]) != len(first["shape"])
            if h["dtype"] != first["dtype"] or shape_differs:
                need = "the same dtype and shape" if same_shape else "the same dtype and number of dimensions"
                raise CollectiveMismatchError(
                    f"{what}: ranks passed incompatible tensors (they need {need}): "
                    + "; ".join(f"rank {r}: {describe_tensor(h)}" for r, h in enumerate(headers))
                )

    if given_check is not None:
        check = given_check
    info = GroupInfo.of(group)
    if info.alone or head is None:
        if header is None:
            header = {"dtype": dtype_name(result.dtype), "shape": list(result.shape)}
        if info.alone:
            exchange_headers(what, header, payload, info, check)  # raises what the ranks would
            return [result]
        head = encode_header(header)
    gathered, fast = gather_tensor_records(head, payload, info, same_shape)
    if fast is not None:  # small tensors of one kind: views of the records, nothing more to check or move
        return fast
    records = read_records(what, head, gathered, info, check)  # raises on a mismatch, or large tensors
    assert isinstance(result, torch.Tensor)
    payloads = [records.inline_payload(r) for r in range(info.world_size)]
    payloads[info.rank] = None if payloads[info.rank] is None else result
    received = exchange_rest(payload, payloads, [view.payload_bytes for view in records.views], info)
    tensors = []
    for r, (h, data) in enumerate(zip(records.headers, received, strict=True)):
        if r == info.rank:
            tensors.append(result)
        elif not data.numel():
            tensors.append(torch.empty(h["shape"], dtype=result.dtype, device=result.device))
        else:
            tensor = data.view(result.dtype).reshape(h["shape"])
            tensors.append(tensor if tensor.device == result.device else tensor.to(result.device))
    return tensors


class AllGatherGrad(torch.autograd.Function):
    """All-gather that gradients flow through (Lightning's ``AllGatherGrad``).

    Forward: this rank's ``tensor`` (same shape and dtype on every rank) ->
    ``(world_size, *tensor.shape)``, row ``r`` from rank ``r``. Backward: the
    incoming gradients ``(world_size, *shape)`` are summed over the ranks
    (one ``all_reduce``) and this rank's row is returned: the gradient of the
    loss summed over every rank's copy of the output, which is what each rank's
    input needs when every rank computes a loss from the gathered tensor (for
    example negatives from all ranks in a contrastive loss). Every rank must run
    the backward pass.
    """

    @override
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
        ctx.group = group
        return torch.stack(_gather(tensor, group, "AllGatherGrad", same_shape=True))

    @override
    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad_output[0].contiguous()
        device = collective_device(ctx.group)
        summed = grad.to(device, copy=True)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=ctx.group)
        return summed[get_rank(ctx.group)].to(grad.device), None


def all_gather_ddp_if_available(
    tensor: torch.Tensor, group: dist.ProcessGroup | None = None, sync_grads: bool = False
) -> torch.Tensor:
    """Gather ``tensor`` from every rank into one ``(world_size, *tensor.shape)`` tensor (Lightning's function).

    Every rank must call it with a tensor of the same shape and dtype.

    Args:
        tensor: this rank's tensor.
        group: the process group; default the whole world.
        sync_grads: let gradients flow back to every rank's ``tensor`` through
            :class:`AllGatherGrad`; otherwise the result does not require grad.

    Returns:
        ``(world_size, *tensor.shape)`` on ``tensor``'s device, row ``r`` from rank
        ``r``. Without a process group: ``tensor`` itself, as Lightning's (note
        the shape: ``tensor.shape``, not ``(1, *tensor.shape)``; reshape with
        ``result.reshape(-1, *tensor.shape[1:])`` to concatenate the ranks' rows
        either way).

    Raises:
        CollectiveMismatchError: shapes or dtypes differ between ranks (on every rank).
    """
    if not is_distributed():
        return tensor
    if sync_grads:
        gathered: torch.Tensor = AllGatherGrad.apply(tensor, group)  # type: ignore[no-untyped-call]
        return gathered
    with torch.no_grad():
        return torch.stack(_gather(tensor, group, "all_gather_ddp_if_available", same_shape=True))
