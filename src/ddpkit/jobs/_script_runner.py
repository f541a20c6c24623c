"""Run a user's script as ``python [-m] script args`` would, recording a failure first.

``ddpkit run`` starts every worker as ``python -u -m ddpkit.jobs._script_runner
script.py args`` so that a failing worker leaves a failure record (see
:mod:`ddpkit._failures`) and the launcher can name the rank that failed first.
The script sees the usual ``__name__ == "__main__"``, ``sys.argv`` and
``sys.path[0]``.
"""

from __future__ import annotations

import os
import runpy
import sys

from ddpkit._failures import FAILURE_DIR_VARIABLE, StopWithoutRestart, earliest, read_records, write_record
from ddpkit._orphans import children_die_with_this_process, die_with_parent
from ddpkit._stores import serve_store
from ddpkit.hangs._watchdog import enable_flight_recorder, hang_timeout, start_watchdog
from ddpkit.jobs._agent_log import is_verbose


def main() -> None:
    """Run the script or module named by ``sys.argv[1:]`` (``script.py args`` or ``-m module args``)."""
    die_with_parent()
    children_die_with_this_process()
    args = sys.argv[1:]
    as_module = bool(args) and args[0] == "-m"
    if as_module:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m ddpkit.jobs._script_runner [-m] SCRIPT_OR_MODULE [ARGS...]")
    try:
        run_target(args[0], args[1:], as_module)
    except Exception as exc:
        directory = os.environ.get(FAILURE_DIR_VARIABLE)
        if not directory or is_verbose():
            raise
        # The agent's summary shows the first failure's traceback (and the log file every rank's):
        # one line here, and none for the ranks that merely lost a peer that had failed.
        rank, first = int(os.environ.get("RANK", "0")), earliest(read_records(directory))
        if first is None or int(first["rank"]) == rank:
            # one write (print makes two): every rank's lines share the stream
            sys.stderr.write(f"[rank{rank}]: {type(exc).__name__}: {str(exc).partition(chr(10))[0]}\n")
        raise SystemExit(1) from None


def run_target(target: str, args: list[str], as_module: bool = False) -> None:
    """Run ``target`` as ``python [-m] target args`` would, in this process, recording a failure first.

    On rank 0, first host the process-group store on ``MASTER_ADDR`` alone when
    that is loopback or an IP address of this machine, as the launcher sets it
    (``init_process_group`` in the script reuses it; torch alone would listen
    on every interface). Unless ``DDPKIT_HANG_TIMEOUT`` is
    ``0``, torch's flight recorder is turned on and a hang watchdog attaches to
    the default process group once the script creates it.
    """
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if os.environ.get("RANK") == "0" and port.isdigit():
        serve_store(address, int(port), if_taken="torch")
    if hang_timeout() is not None:  # watch the group the script creates, plain init_process_group included
        enable_flight_recorder()
        start_watchdog(wait_for_group=True)
    sys.argv = [target, *args]
    directory = os.environ.get(FAILURE_DIR_VARIABLE)
    try:
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if directory and exc.code not in (None, 0):
            write_record(directory, exc)
        if directory and isinstance(exc, StopWithoutRestart):
            raise SystemExit(0) from None  # the agent ends instead of starting the workers again (see its record)
        raise
    except BaseException as exc:
        if directory:
            write_record(directory, exc)
        raise


if __name__ == "__main__":
    main()
