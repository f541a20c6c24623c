"""How the quorums' process group waits, bounded: its set-up for its members (:class:`Within`), each collective for
a member that stopped (:class:`Watched`), and the end of a group aborted while a collective still runs in it
(:func:`reap`)."""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ddpkit._stores import ForwardingStore

__all__ = ["WATCH_AFTER_S", "Watched", "Within", "reap"]


class Within(ForwardingStore):
    """A quorum's store as gloo sees it while the group is made: every wait ends by one deadline, ``seconds`` from
    now, so that the set-up costs at most that however many members never write their address (gloo waits for
    each in turn, with the store's own timeout); everything else as ``inner`` does it."""

    def __init__(self, inner: Any, seconds: float) -> None:
        super().__init__(inner)
        self._deadline = time.monotonic() + seconds

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        left = max(0.001, self._deadline - time.monotonic())
        self._inner.wait(keys, timedelta(seconds=left if timeout is None else min(left, timeout.total_seconds())))


#: Seconds a collective of the quorum's group waits before it asks whether it can still complete.
WATCH_AFTER_S = 1.0


def _reap(groups: queue.SimpleQueue[tuple[Any, float]]) -> None:
    """Hold each group put in ``groups`` until its time (once any collective left running in it has timed out),
    then drop it, in this thread: gloo's group joins its threads when it ends, which waits for such a collective
    (one that a stopped member never completes), and torchft's configuration would otherwise drop it itself. No
    group is dropped once the process exits (:func:`_at_exit`)."""
    while True:
        group, until = groups.get()
        time.sleep(max(0.0, until - time.monotonic()))
        with _letting_go:
            del group


_REAPED: queue.SimpleQueue[tuple[Any, float]] = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None
#: Held while the reaper drops a group, and for good once the process exits.
_letting_go = threading.Lock()
#: Seconds the exit waits for a group being dropped at that moment.
_EXIT_WAIT_S = 30.0


def reap(group: Any, until: float) -> None:
    """Let go of an aborted quorum group at ``until`` (``time.monotonic()`` seconds) in a thread of its own (see
    :func:`_reap`), started with the first such group: a process that never aborts one runs no such thread."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, args=(_REAPED,), name="ddpkit-quorum-group-reaper", daemon=True)
            _reaper.start()
            atexit.register(_at_exit)
    _REAPED.put((group, until))


def _at_exit() -> None:
    """Once the process exits, the reaper drops no group (a group dropped in the reaper's daemon thread while the
    interpreter finalizes aborts the process: SIGABRT, ``terminate called without an active exception``, when
    the thread, back from gloo's destructor, finds the interpreter gone). A group being dropped now is dropped
    first; the others stay held by the reaper's thread and end with the process."""
    _letting_go.acquire(timeout=_EXIT_WAIT_S)  # never released


class Watched(torch.distributed.Work):
    """A collective of the quorum's group whose wait ends early when it cannot complete: after
    :data:`WATCH_AFTER_S` seconds it asks ``doomed()`` every 0.1 s, and raises its reason (torchft then fails the
    step, as for any error of the group) instead of waiting the group's timeout for a member that stopped (SIGSTOP,
    a machine that froze: its connections stay open and gloo waits) or for others that went on without this group.
    The collective itself runs on in gloo's thread until its timeout; nothing waits for it.

    The waits are the collective's own, with a timeout (torch's ``Work.wait(timeout)``, whose "timed out" leaves
    the collective running): a collective that completes in time costs one wait, as unwatched."""

    def __init__(self, work: Any, doomed: Callable[[], str | None]) -> None:
        super().__init__()
        self._work, self._doomed = work, doomed

    def wait(self, timeout: timedelta | None = None) -> bool:
        began = time.monotonic()
        limit = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        span = WATCH_AFTER_S if limit is None else min(WATCH_AFTER_S, limit)
        while True:
            try:
                return bool(self._work.wait(timedelta(seconds=span)))
            except RuntimeError:
                if self._work.is_completed():  # it failed, or completed as it timed out: its own wait says which
                    return bool(self._work.wait())
            waited = time.monotonic() - began
            if limit is not None and waited >= limit:
                break  # the collective's own wait raises its timeout
            if waited >= WATCH_AFTER_S and (why := self._doomed()) is not None:
                raise RuntimeError(f"the quorum's collective cannot complete: {why}")
            span = 0.1 if limit is None else max(0.001, min(0.1, limit - waited))
        return bool(self._work.wait(timedelta(seconds=0.001)))

    def get_future(self) -> Any:
        return self._work.get_future()

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def source_rank(self) -> int:
        return int(self._work.source_rank())

    def result(self) -> Any:
        return self._work.result()

    def synchronize(self) -> None:
        self._work.synchronize()

    def block_current_stream(self) -> None:
        self._work.block_current_stream()
