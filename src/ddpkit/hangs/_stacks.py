"""Python stacks for a hang report: this process's threads, its children's dumps, and whose code a frame is.

A frame is ``[filename, line, function, source text]``, outermost first. A
child process (a DataLoader worker, say) cannot be asked from Python for its
stack; instead each child installs :func:`install_stack_dump` (forked children
through an at-fork hook, spawned DataLoader workers through
:class:`StackDumpOnSignal`), which dumps every thread's stack into a private,
unlinked file on SIGUSR2, and :func:`children_stacks` signals each child and
reads that file through ``/proc/PID/fd``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import linecache
import multiprocessing
import os
import re
import signal
import site
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ddpkit._orphans import die_with_parent
from ddpkit.hangs._state import ChildStack, ThreadStack

__all__ = [
    "StackDumpOnSignal",
    "children_stacks",
    "ddpkit_collective",
    "dump_stacks_in_forked_children",
    "dumped_frames",
    "frame_text",
    "install_stack_dump",
    "is_ddpkits",
    "is_users",
    "kill_children",
    "marked",
    "thread_stacks",
    "user_frame",
]

_STACK_FILE_PREFIX = "ddpkit-stacks-"
#: This process's stack-dump file, and the pid that made it (a forked child makes its own).
_stack_dump: tuple[int, Any] | None = None
_hooked_forks = False


def install_stack_dump() -> None:
    """Dump this process's Python stacks into a private file on SIGUSR2 (for a hang report of its parent).

    The file is unlinked at once (its parent reads it through ``/proc/PID/fd``), so
    nothing is left behind. Nothing happens where SIGUSR2 has a handler already.
    """
    global _stack_dump
    if not hasattr(signal, "SIGUSR2") or (_stack_dump is not None and _stack_dump[0] == os.getpid()):
        return
    if signal.getsignal(signal.SIGUSR2) not in (signal.SIG_DFL, None):
        return
    try:
        handle = tempfile.NamedTemporaryFile(mode="w+", prefix=_STACK_FILE_PREFIX, delete=False)  # noqa: SIM115
        os.unlink(handle.name)
        faulthandler.register(signal.SIGUSR2, file=handle, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        return
    _stack_dump = (os.getpid(), handle)


class StackDumpOnSignal:
    """A DataLoader ``worker_init_fn`` that first makes the worker die with its rank and dump its stacks on
    SIGUSR2 (:func:`install_stack_dump`), then calls the user's own function (picklable, so spawned workers get
    it too)."""

    def __init__(self, worker_init_fn: Any = None) -> None:
        self.worker_init_fn = worker_init_fn

    def __call__(self, worker_id: int) -> None:
        die_with_parent()  # a spawned worker gets no at-fork hook
        install_stack_dump()
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)


def dump_worker_stacks_in_hang_reports(loaders: Iterable[Any]) -> None:
    """The DataLoader workers of ``loaders`` (ones ddpkit built, whose ``worker_init_fn`` it may wrap) show
    their stacks in a hang report, also when they are spawned (as in a worker of ``launch``)."""
    for loader in loaders:
        if loader.num_workers > 0 and not isinstance(loader.worker_init_fn, StackDumpOnSignal):
            loader.worker_init_fn = StackDumpOnSignal(loader.worker_init_fn)


def dump_stacks_in_forked_children() -> None:
    global _hooked_forks
    if not _hooked_forks and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=install_stack_dump)
        _hooked_forks = True


def children_stacks() -> list[ChildStack]:
    """``{"pid", "name", "stack"}`` of each child of this process; the stack is its dump (see the module
    docstring), or a note when it does not dump it."""
    stacks: list[ChildStack] = []
    for child in multiprocessing.active_children():
        pid = child.pid
        if pid is None:
            continue
        dump = _stack_file_of(pid) if _handles_sigusr2(pid) else None
        stack = _signal_and_read(pid, dump) if dump else "(no stack: it does not dump it on SIGUSR2)"
        stacks.append({"pid": pid, "name": child.name, "stack": stack})
    return stacks


def thread_stacks(skip: int) -> list[ThreadStack]:
    """Every thread's stack but the watchdog's, outermost frame first; the main thread first."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    threads: list[ThreadStack] = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        frames = [[f.filename, f.lineno, f.name, (f.line or "").strip()] for f in traceback.extract_stack(frame)]
        threads.append({"name": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    return sorted(threads, key=lambda t: not t.get("main"))


def kill_children() -> None:
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()


def _stack_file_of(pid: int) -> str | None:
    """``/proc/PID/fd/N`` of the child's unlinked stack-dump file, or ``None``."""
    directory = f"/proc/{pid}/fd"
    try:
        for fd in os.listdir(directory):
            with contextlib.suppress(OSError):
                if _STACK_FILE_PREFIX in os.readlink(f"{directory}/{fd}"):
                    return f"{directory}/{fd}"
    except OSError:
        return None
    return None


def _signal_and_read(pid: int, dump: str) -> str:
    """Ask process ``pid`` for its stacks; what it writes within a second, once its dump stops growing."""
    try:
        with open(dump, encoding="utf-8", errors="replace") as handle:
            start = handle.seek(0, os.SEEK_END)
            os.kill(pid, signal.SIGUSR2)
            text, previous = "", None
            for _ in range(20):
                time.sleep(0.05)
                handle.seek(start)
                text = handle.read()
                if text and text == previous:
                    break
                previous = text
    except OSError as exc:
        return f"(no stack: {exc})"
    return text


def _handles_sigusr2(pid: int) -> bool:
    """Whether process ``pid`` catches SIGUSR2 (Linux ``/proc/PID/status``), so that it dumps instead of dying."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR2 - 1) & 1)
    return False


def user_frame(frames: Iterable[list[Any]]) -> list[Any] | None:
    """The innermost frame of the user's own code: not torch, ddpkit's machinery, the standard library or an
    installed package (ddpkit's bundled examples count as user code)."""
    found = None
    for frame in frames:
        if is_users(str(frame[0])):
            found = frame
    return found


def ddpkit_collective(frames: Sequence[list[Any]]) -> str | None:
    """The name of ddpkit's collective function that the user's code called to get to these frames
    (``"gather_all_tensors"``), when the frame right inside the innermost user frame is one; else ``None``.
    A ddpkit collective moves its bytes with torch's own collectives (a gather's records with an
    ``all_to_all`` on gloo), so the report names the function the user called beside them."""
    users = [index for index, frame in enumerate(frames) if is_users(str(frame[0]))]
    if not users or users[-1] + 1 >= len(frames):
        return None
    callee = frames[users[-1] + 1]
    path, function = os.path.abspath(str(callee[0])), str(callee[2])
    return function if path.startswith(_COLLECTIVES) and not function.startswith("_") else None


def dumped_frames(dump: str) -> list[list[Any]]:
    """The frames of the current thread in a ``faulthandler`` dump, outermost first, with their source lines."""
    block = dump.split("Current thread", 1)[1] if "Current thread" in dump else dump
    frames: list[list[Any]] = []
    for line in block.splitlines()[1:]:
        match = _DUMP_FRAME.match(line)
        if match is None:
            break
        filename, number, function = match.group(1), int(match.group(2)), match.group(3)
        frames.append([filename, number, function, linecache.getline(filename, number).strip()])
    return frames[::-1]


_DUMP_FRAME = re.compile(r'\s+File "(.*)", line (\d+) in (.*)$')


def frame_text(frame: list[Any]) -> str:
    filename, line, function = _short_path(str(frame[0])), frame[1], frame[2]
    text = f"{filename}:{line} in {function}"
    source = frame[3] if len(frame) > 3 else ""
    return f"{text}: {source}" if source else text


def marked(frame: list[Any]) -> str:
    return ("> " if is_users(str(frame[0])) else "  ") + frame_text(frame)


#: ddpkit's package directory (``.../ddpkit/``), found once for an editable and an installed copy alike: its
#: modules are ddpkit's machinery, never the user's code (its bundled examples excepted).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_EXAMPLES = os.path.join(_PACKAGE, "examples") + os.sep
_COLLECTIVES = os.path.join(_PACKAGE, "collectives") + os.sep


def _library_roots() -> tuple[str, ...]:
    roots = {_PACKAGE, *(p + os.sep for p in site.getsitepackages() if p)}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.abspath(path) + os.sep)
    return tuple(sorted(roots))


_LIBRARY_ROOTS = _library_roots()


def _short_path(filename: str) -> str:
    """A library file relative to its installation (``torch/distributed/distributed_c10d.py``), a file under
    the working directory relative to it; anything else as it is."""
    if filename.startswith("<"):
        return filename
    path = os.path.abspath(filename)
    for root in sorted(_LIBRARY_ROOTS, key=len, reverse=True):
        if path.startswith(root) and not path.startswith(_PACKAGE):
            return path[len(root) :]
    if path.startswith(_PACKAGE):
        return "ddpkit/" + path[len(_PACKAGE) :]
    cwd = os.getcwd() + os.sep
    return path[len(cwd) :] if path.startswith(cwd) else filename


def is_ddpkits(filename: str) -> bool:
    """Whether ``filename`` is one of ddpkit's own modules (its examples included)."""
    return os.path.abspath(filename).startswith(_PACKAGE)


def is_users(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_EXAMPLES):
        return True
    return not path.startswith(_LIBRARY_ROOTS)
