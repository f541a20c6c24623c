"""Rank zero: code that runs on it only (:func:`rank_zero_only`), or on it first (:func:`rank_zero_first`).

``rank_zero_first`` has its own small protocol: rank 0 broadcasts whether its
body raised (and the error's text), so the other ranks raise instead of
waiting for a result that will never come.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist

from ddpkit.errors import DDPKitError
from ddpkit.hangs import _watchdog as watchdog
from ddpkit.process_group._ranks import collective_device, is_distributed, process_rank

__all__ = ["rank_zero_first", "rank_zero_only"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


def rank_zero_only(fn: Callable[P, T]) -> Callable[P, T | None]:
    """Decorator: call ``fn`` on global rank 0 only; other ranks get ``None``.

    The rank is the process group's when one exists, else the cluster
    environment's (so it is right in a torchrun worker before initialisation).

    Example:
        >>> @rank_zero_only
        ... def log_once(message: str) -> None:
        ...     print(message)
    """

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> T | None:
        if process_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return wrapped


@contextmanager
def rank_zero_first(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the body on rank 0 of ``group`` first, then on the other ranks.

    For work that must happen once before the others read its result (download
    a data set, build a cache). Every rank of ``group`` must enter it. If rank 0
    raises inside the body, the other ranks are still released and raise
    :class:`~ddpkit.DDPKitError` carrying rank 0's error instead of running their
    body; nothing hangs. Costs one broadcast (two when rank 0 failed). Without a
    process group it just runs the body. The other ranks' wait does not count
    towards the hang timeout.

    Raises:
        DDPKitError: on ranks other than 0, when rank 0's body raised.
    """
    if not is_distributed():
        yield
        return
    device = collective_device(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank(group) == 0:
        failure: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _send_status(failure, src, device, group)
    else:
        with watchdog.paused():  # rank 0 may take long (a download): waiting for it is not a hang
            error = _receive_status(src, device, group)
        if error is not None:
            raise DDPKitError(f"rank 0 failed inside rank_zero_first, so this rank did not run its body: {error}")
        yield


def _send_status(
    failure: BaseException | None, src: int, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    message = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:65536]
    status = torch.tensor([int(failure is not None), len(message)], dtype=torch.int64, device=device)
    try:
        dist.broadcast(status, src=src, group=group)
        if failure is not None:
            payload = torch.tensor(list(message) or [0], dtype=torch.uint8, device=device)
            dist.broadcast(payload, src=src, group=group)
    except Exception:
        if failure is None:
            raise
        log.exception("rank_zero_first: could not tell the other ranks that rank 0 failed")


def _receive_status(src: int, device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    status = torch.zeros(2, dtype=torch.int64, device=device)
    dist.broadcast(status, src=src, group=group)
    if not int(status[0]):
        return None
    payload = torch.zeros(max(int(status[1]), 1), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return bytes(payload[: int(status[1])].tolist()).decode(errors="replace")
