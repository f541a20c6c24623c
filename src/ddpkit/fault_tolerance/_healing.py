"""How a recovering replica group takes a healthy peer's state: tensors and plain values over the groups'
process group, nothing unpickled (a torchft ``CheckpointTransport``).

The sender sends, to each recovering group: a header's length, the header (the state with every tensor
replaced by an empty one of its dtype, each tensor's shape, the step: ddpkit's pickle-free encoding), then
each tensor's bytes. The receiver reads the header without pickle, checks it against its own state and only
then receives each tensor into one it allocated itself: a tensor that the recovering group has (its model's
weights, its random state) must come with the same shape and dtype; one it does not have yet (an optimizer's
state before its first step) counts against a budget of four times the bytes of its own tensors plus
:data:`EXTRA_BYTES`, and so does the header. Anything else is refused with a message that says what and
where, before any of it is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from ddpkit.collectives._codec import dtype_name, pack, unpack

__all__ = ["EXTRA_BYTES", "HealingRefusedError", "TensorTransport"]

#: Bytes a recovering group accepts beyond four times its own tensors' bytes (header and new tensors together).
EXTRA_BYTES = 64 << 20
_OWN_FACTOR = 4
_LENGTH, _HEADER, _FIRST_TENSOR = 1, 2, 3  # the tags of the messages


class HealingRefusedError(ValueError):
    """What a peer sent as its state is not the state this group can take (says what and where)."""


Path = tuple[Any, ...]


def _tensors(tree: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in ``tree`` (dicts, lists and tuples walked in order; sets are values) with its path."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, (*path, key))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _tensors(value, (*path, index))


def _replaced(tree: Any, new: Callable[[torch.Tensor], Any]) -> Any:
    """``tree`` with each tensor (in :func:`_tensors`'s order) replaced by ``new(tensor)``."""
    if isinstance(tree, torch.Tensor):
        return new(tree)
    if isinstance(tree, dict):
        return {key: _replaced(value, new) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        items = [_replaced(value, new) for value in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _where(path: Path) -> str:
    return "state" + "".join(f"[{key!r}]" for key in path)


def _nbytes(shape: list[int], dtype: torch.dtype) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * dtype.itemsize


class TensorTransport:
    """torchft's ``CheckpointTransport`` over the quorum's process group, without pickle.

    Args:
        group: the replica groups' process group (torchft's; the transport uses ``send`` and ``recv``).
        own_state: this group's own state as torchft hands it over (``{"user": ..., "torchft": ...}``): what
            a received state must match.
        timeout: seconds each message may take (default 30).
    """

    def __init__(self, group: Any, own_state: Callable[[], dict[str, Any]], timeout: float = 30.0) -> None:
        self._group, self._own_state, self._timeout = group, own_state, timedelta(seconds=timeout)

    def metadata(self) -> str:
        """Nothing to look up: the state comes over the process group."""
        return "<process group>"

    def disallow_checkpoint(self) -> None:
        """Sending is over when :meth:`send_checkpoint` returns."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop."""

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Send ``state_dict`` (tensors and plain values) to each group in ``dst_ranks``; returns when sent.

        Raises:
            TypeError: the state holds something other than tensors and plain values (naming where).
        """
        tensors = [tensor.detach().contiguous().cpu() for _, tensor in _tensors(state_dict)]
        skeleton = _replaced(state_dict, lambda tensor: torch.empty(0, dtype=tensor.dtype))
        header = pack({"step": step, "state": skeleton, "shapes": [list(tensor.shape) for tensor in tensors]})
        length = torch.tensor([header.numel()], dtype=torch.int64)
        works = []
        for rank in dst_ranks:
            works.append(self._group.send([length], rank, _LENGTH))
            works.append(self._group.send([header], rank, _HEADER))
            for index, tensor in enumerate(tensors):
                if tensor.numel():
                    works.append(self._group.send([tensor.reshape(-1).view(torch.uint8)], rank, _FIRST_TENSOR + index))
        for work in works:
            work.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """The state the group at ``src_rank`` sends, checked against this group's own before anything is
        allocated for it.

        Raises:
            HealingRefusedError: the header is too large, not ddpkit's encoding, of another step, or names a tensor
                of another shape or dtype than this group's, or new tensors beyond the budget.
        """
        own = dict(_tensors(self._own_state()))
        budget = _OWN_FACTOR * sum(tensor.numel() * tensor.element_size() for tensor in own.values()) + EXTRA_BYTES
        length = torch.zeros(1, dtype=torch.int64)
        self._group.recv([length], src_rank, _LENGTH).wait(timeout)
        size = int(length.item())
        if not 0 < size <= budget:
            raise HealingRefusedError(
                f"the state offered by replica rank {src_rank} has a header of {size} bytes; this group takes at "
                f"most {budget} (four times its own state's tensors plus {EXTRA_BYTES >> 20} MiB)"
            )
        header = torch.empty(size, dtype=torch.uint8)
        self._group.recv([header], src_rank, _HEADER).wait(timeout)
        try:
            sent = unpack(header)  # never unpickles
            sent_step, skeleton, shapes = sent["step"], sent["state"], sent["shapes"]
        except Exception as exc:
            raise HealingRefusedError(
                f"the state offered by replica rank {src_rank} is not ddpkit's pickle-free encoding of a state "
                f"({type(exc).__name__}: {exc}); nothing of it was taken"
            ) from None
        if sent_step != step:
            raise HealingRefusedError(
                f"replica rank {src_rank} offered the state of step {sent_step!r}, not of step {step}"
            )
        placeholders = list(_tensors(skeleton))
        plan = self._plan(placeholders, shapes, own, budget - size, src_rank)
        received = iter(plan)

        def take(placeholder: torch.Tensor) -> torch.Tensor:
            index, tensor = next(received)
            if tensor.numel():
                self._group.recv([tensor.reshape(-1).view(torch.uint8)], src_rank, _FIRST_TENSOR + index).wait(timeout)
            return tensor

        return _replaced(skeleton, take)

    @staticmethod
    def _plan(
        placeholders: list[tuple[Path, torch.Tensor]], shapes: Any, own: dict[Path, torch.Tensor], budget: int,
        src_rank: int,
    ) -> list[tuple[int, torch.Tensor]]:  # fmt: skip
        """One tensor, allocated here, for each placeholder, after every check passed.

        Raises:
            HealingRefusedError: see :meth:`recv_checkpoint`.
        """
        if not isinstance(shapes, list) or len(shapes) != len(placeholders):
            raise HealingRefusedError(
                f"the state offered by replica rank {src_rank} does not list one shape per tensor"
            )
        checked: list[tuple[list[int], torch.dtype]] = []
        new_bytes = 0
        for (path, placeholder), shape in zip(placeholders, shapes, strict=True):
            if not isinstance(shape, list) or not all(type(size) is int and size >= 0 for size in shape):
                raise HealingRefusedError(f"{_where(path)}: {shape!r} is not a tensor shape")
            mine = own.get(path)
            if mine is not None:
                if list(mine.shape) != shape or mine.dtype != placeholder.dtype:
                    raise HealingRefusedError(
                        f"{_where(path)}: replica rank {src_rank} offered a {dtype_name(placeholder.dtype)} tensor of "
                        f"shape {tuple(shape)}, this group's is {dtype_name(mine.dtype)} of shape {tuple(mine.shape)}: "
                        "the groups do not train the same model (start every group from the same script and settings)"
                    )
            else:
                new_bytes += _nbytes(shape, placeholder.dtype)
                if new_bytes > budget:
                    raise HealingRefusedError(
                        f"{_where(path)}: the tensors replica rank {src_rank} offered that this group does not have "
                        f"come to more than the {budget} bytes it takes (four times its own state's tensors plus "
                        f"{EXTRA_BYTES >> 20} MiB)"
                    )
            checked.append((shape, placeholder.dtype))
        return [(index, torch.empty(shape, dtype=dtype)) for index, (shape, dtype) in enumerate(checked)]
