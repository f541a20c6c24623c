"""Workers die with the process that started them, so none is ever left behind (private).

If the launcher is killed (``kill -9``, an out-of-memory kill, a CI timeout),
its workers would otherwise live on as orphans, often blocked for good in a
collective. On Linux each worker asks the kernel for ``SIGKILL`` when its
parent exits (``prctl(PR_SET_PDEATHSIG)``). The signal follows the parent
*thread*: start workers from a thread that outlives them (ddpkit does).

A worker's own children (a DataLoader's forked workers, blocked in a user's
dataset code, say) would outlive a worker that is stopped the same way:
:func:`children_die_with_this_process` makes every child it forks ask too.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["children_die_with_this_process", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
_registered = False


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have this process killed when its parent exits (Linux; elsewhere it does nothing).

    Args:
        parent_pid: the parent this process expects; if it already died before
            the request was made, exit at once instead of running as an orphan.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before we asked


def children_die_with_this_process() -> None:
    """Have every child this process forks from now on (DataLoader workers, say) killed when it exits.

    Once per process (an ``os.register_at_fork`` hook); Linux only.
    """
    global _registered
    if _registered or not sys.platform.startswith("linux"):
        return
    os.register_at_fork(after_in_child=die_with_parent)
    _registered = True
