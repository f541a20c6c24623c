"""Workers die with the process that started them, so none is ever left behind (layer 5, private).

If the launcher is killed (``kill -9``, an out-of-memory kill, a CI timeout),
its workers would otherwise live on as orphans, often blocked for good in a
collective. On Linux each worker asks the kernel for ``SIGKILL`` when its
parent exits (``prctl(PR_SET_PDEATHSIG)``). The signal follows the parent
*thread*: start workers from a thread that outlives them (ddpkit does).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


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
