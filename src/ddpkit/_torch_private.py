"""The private parts of torch and torchft that ddpkit uses, every one of them in this module.

A private name (``_get_default_store``, ``torch._foreach_norm``, a class whose name starts with ``_``) is one
that torch or torchft may rename or remove in any release without notice. ddpkit reaches such a name only
through :func:`private`, which resolves it once and, where the installed release has no such name, raises
:class:`PrivateNameError` naming it, what ddpkit needs it for, the installed version and the versions ddpkit is
tested with: a clear error at the first use instead of an ``AttributeError`` deep in a job (or, worse, code that
silently does something else). :data:`NAMES` lists every one; :func:`check` resolves them all at once
(``tests/unit/test_torch_private.py`` on every supported release, ``tools/gpu-check.sh`` on a GPU machine).

At import this module checks the installed torch against :data:`TORCH_FLOOR` and refuses an older one.

Where torch has a public name for the same thing (``torch.distributed.group.WORLD``, ``torch.distributed.Work``,
``torch.compiler.list_backends``, ``torchft.coordination.LighthouseServer``) ddpkit uses that instead, outside
this module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

__all__ = [
    "NAMES",
    "TORCH_FLOOR",
    "TORCH_TESTED",
    "PrivateName",
    "PrivateNameError",
    "check",
    "default_store",
    "gloo_on_device",
    "group_timeout",
    "inner_of_compiled",
    "module_global_swapped",
    "private",
    "report",
    "set_group_timeout",
    "worker_info_hidden",
]

#: The oldest torch ddpkit runs on: the oldest its tests have passed on (:data:`TORCH_TESTED`). FSDP2's public
#: ``fully_shard`` and DCP's ``async_save`` alone would allow 2.6, untested.
TORCH_FLOOR = (2, 11)
#: The torch releases ddpkit's tests have passed on (2.11 on the GPU machines, 2.13 in CI).
TORCH_TESTED = "2.11 and 2.13"


def _release(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


if _release(torch.__version__) < TORCH_FLOOR:
    raise ImportError(
        f"ddpkit needs torch {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} or newer and found torch {torch.__version__}: "
        f"pip install 'torch>={TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}' (tested with {TORCH_TESTED})"
    )


class PrivateNameError(ImportError):
    """The installed torch or torchft no longer has a private name that ddpkit uses."""


@dataclass(frozen=True)
class PrivateName:
    """A private name ddpkit uses: ``module`` (imported) and ``path`` (attributes from it, dotted; ``""``: the
    module itself), with ``why`` it is needed, said in the error when it is missing."""

    module: str
    path: str
    why: str

    @property
    def package(self) -> str:
        return self.module.split(".")[0]


#: Every private name of torch and torchft that ddpkit uses, by the key :func:`private` takes.
NAMES: dict[str, PrivateName] = {
    "default_store": PrivateName(
        "torch.distributed.distributed_c10d", "_get_default_store",
        "the default group's store, where the hang watchdog's and a group's sealed keys and gloo's addresses are",
    ),
    "set_group_timeout": PrivateName(
        "torch.distributed.distributed_c10d", "_set_pg_timeout",
        "a group's deadline while its members prove the job secret, restored afterwards",
    ),
    "allgather_options": PrivateName(
        "torch._C._distributed_c10d", "AllgatherOptions", "the options of a quorum group's all_gather (torchft's)",
    ),
    "gloo_options": PrivateName(
        "torch.distributed", "ProcessGroupGloo._Options",
        "a quorum's gloo group on one device (the machine's address) with its own set-up deadline",
    ),
    "foreach_norm": PrivateName(
        "torch", "_foreach_norm", "the weights' norms every replica group checks after a fault-tolerant commit",
    ),
    "foreach_copy_": PrivateName(
        "torch", "_foreach_copy_", "the reduced gradients copied back into the parameters' gradients in one operation",
    ),
    "checkpoint_wrapper": PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
        "activation checkpointing (activation_checkpointing_policy), as torchtitan and Lightning apply it",
    ),
    "checkpoint_impl": PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl",
        "activation checkpointing without reentrancy",
    ),
    "checkpoint_wrapper_class": PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointWrapper",
        "finding the submodules activation checkpointing wrapped",
    ),
    "apply_activation_checkpointing": PrivateName(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "apply_activation_checkpointing",
        "wrapping the submodules an activation checkpointing policy chooses",
    ),
    "powersgd_orthogonalize": PrivateName(
        "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook", "_orthogonalize",
        "telling whether this torch's batched_powerSGD_hook can run",
    ),
    "matches_machine_hostname": PrivateName(
        "torch.distributed.elastic.rendezvous.utils", "_matches_machine_hostname",
        "whether this node hosts the rendezvous, as torchrun decides it",
    ),
    "rendezvous_node": PrivateName(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc",
        "checking a rendezvous state before torch unpickles it",
    ),
    "rendezvous_state": PrivateName(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState",
        "checking a rendezvous state before torch unpickles it",
    ),
    "rendezvous_state_holder": PrivateName(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousStateHolder",
        "the rendezvous handler that checks each state it reads",
    ),
    "worker_info_module": PrivateName(
        "torch.utils.data._utils", "worker",
        "reading a stream's shards in the main process as a DataLoader's worker would not",
    ),
    "flight_recorder_json": PrivateName(
        "torch._C._distributed_c10d", "_dump_fr_trace_json", "the hang report's collectives (the flight recorder)",
    ),
    "flight_recorder": PrivateName(
        "torch._C._distributed_c10d", "_dump_fr_trace", "the hang report's collectives (the flight recorder)",
    ),
    "ddp_rebuild_buckets": PrivateName(
        "torch._C._distributed_c10d", "Reducer._rebuild_buckets",
        "arming DDP's reducer for a backward whose loss did not come through the DDP model's forward (as Lightning)",
    ),
    "dynamo": PrivateName(
        "torch._dynamo", "", "preloading what DDP's constructor imports in a forkserver (2 s a worker otherwise)",
    ),
    "optimized_module": PrivateName(
        "torch._dynamo.eval_frame", "OptimizedModule", "the module inside what torch.compile returns",
    ),
    "torchft_gloo_class": PrivateName(
        "torchft.process_group", "BaseProcessGroupGloo",
        "a quorum's gloo group on the machine's address, made within its members' deadline",
    ),
    # Private methods ddpkit's subclasses override: a rename would leave the override silently unused.
    "rendezvous_wrap_store": PrivateName(
        "torch.distributed.elastic.rendezvous.dynamic_rendezvous", "DynamicRendezvousHandler._wrap_store",
        "signing every key of a rendezvous round (ddpkit's handler overrides it)",
    ),
    "torchft_create_pg": PrivateName(
        "torchft.process_group", "ProcessGroupGloo._create_pg",
        "proving a quorum's members over the group's own store (ddpkit's quorum group overrides it)",
    ),
    "torchft_wrap_work": PrivateName(
        "torchft.process_group", "ProcessGroupWrapper._wrap_work",
        "ending a quorum collective's wait when it cannot complete (ddpkit's quorum group overrides it)",
    ),
}  # fmt: skip


def _version(package: str) -> str:
    if package == "torch":
        return str(torch.__version__)
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return "?"


@functools.cache
def private(key: str) -> Any:
    """The private name :data:`NAMES` holds under ``key``, resolved once.

    Raises:
        PrivateNameError: the installed torch (or torchft) has no such name; the message names it, what ddpkit
            uses it for, the installed and the tested versions, and the fix.
        ImportError: torchft is not installed (for torchft's names).
    """
    name = NAMES[key]
    try:
        found: Any = importlib.import_module(name.module)
        for part in filter(None, name.path.split(".")):
            found = getattr(found, part)
    except ModuleNotFoundError as missing:
        if missing.name is not None and missing.name.split(".")[0] != name.package:
            raise
        raise PrivateNameError(_missing(name)) from missing
    except AttributeError as missing:
        raise PrivateNameError(_missing(name)) from missing
    return found


def _missing(name: PrivateName) -> str:
    tested = TORCH_TESTED if name.package == "torch" else "0.2.0"
    where = f"{name.module}.{name.path}" if name.path else name.module
    return (
        f"{name.package} {_version(name.package)} has no {where}, which ddpkit uses for {name.why} "
        f"(a private name, tested with {name.package} {tested}): install {name.package} "
        f"{'2.13' if name.package == 'torch' else '0.2.0'}, or a ddpkit release that supports "
        f"{name.package} {_version(name.package)}"
    )


def check(*, torchft: bool | None = None) -> dict[str, str]:
    """Resolve every name of :data:`NAMES`: ``{key: why it failed}`` for those that did not (``{}``: all there).
    torchft's names are checked when ``torchft`` is true, or (``None``) when torchft is installed."""
    if torchft is None:
        torchft = importlib.util.find_spec("torchft") is not None
    failed = {}
    for key, name in NAMES.items():
        if name.package == "torchft" and not torchft:
            continue
        try:
            private(key)
        except ImportError as error:
            failed[key] = str(error)
    return failed


# --- what the call sites need, in one line each ---------------------------------------------------


def default_store() -> Any:
    """The default process group's store (the one ``init_process_group`` made or was given)."""
    return private("default_store")()


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Give ``group`` (``None``: the default group) the timeout ``timeout`` for its next collectives."""
    private("set_group_timeout")(timeout, group)


def group_timeout(group: Any, device: torch.device) -> timedelta | None:
    """``group``'s timeout on ``device``'s backend (``None`` where the backend does not say)."""
    try:
        found = group._get_backend(device).options._timeout
    except Exception:  # another backend, or another torch
        return None
    return found if isinstance(found, timedelta) else None


def gloo_on_device(store: Any, rank: int, size: int, address: str | None, timeout: timedelta) -> Any:
    """torch's ``ProcessGroupGloo`` of ``size`` members with one device, on ``address`` (``None``: gloo's own
    choice), made within ``timeout`` (torch's options have no public setters; its own groups fill them alike)."""
    gloo = torch.distributed.ProcessGroupGloo
    options = private("gloo_options")()
    options._timeout = timeout
    options._devices = [gloo.create_device(hostname=address) if address else gloo.create_default_device()]
    return gloo(store, rank, size, options)


def inner_of_compiled(model: Any) -> Any:
    """The module inside what ``torch.compile`` returned, else ``None`` (without importing torch's compiler: a
    process that never compiled has no such module)."""
    if not hasattr(model, "_orig_mod") or "torch._dynamo" not in sys.modules:
        return None
    try:
        optimized = private("optimized_module")
    except ImportError:
        return None
    inner = getattr(model, "_orig_mod", None) if isinstance(model, optimized) else None
    return inner if isinstance(inner, torch.nn.Module) else None


@contextlib.contextmanager
def worker_info_hidden() -> Iterator[None]:
    """Within the block, ``torch.utils.data.get_worker_info()`` is ``None`` in this thread's process (restored
    afterwards), so that a dataset's ``__iter__`` called from a worker reads as the main process's would."""
    worker = private("worker_info_module")
    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


_SWAPS = threading.Lock()
_swapped: dict[tuple[int, str], tuple[Any, int]] = {}


@contextlib.contextmanager
def module_global_swapped(module: Any, name: str, replacement: Any) -> Iterator[None]:
    """Within the block, ``module.name`` is ``replacement``; the original comes back when the last block open on
    that name (in any thread) closes. Blocks may overlap across threads: each sees ``replacement`` while it is
    open, so the replacement must itself fall back to the original where it has nothing to add (ddpkit's do)."""
    key = (id(module), name)
    with _SWAPS:
        original, count = _swapped.get(key, (getattr(module, name), 0))
        _swapped[key] = (original, count + 1)
        setattr(module, name, replacement)
    try:
        yield
    finally:
        with _SWAPS:
            original, count = _swapped[key]
            if count == 1:
                del _swapped[key]
                setattr(module, name, original)
            else:
                _swapped[key] = (original, count - 1)


def report() -> int:
    """Print every private name this torch (and torchft) lacks, then one line; 1 if any is missing, else 0
    (``tools/torch-matrix.sh`` and ``tools/gpu-check.sh`` run it on each release)."""
    missing = check()
    for key, why in missing.items():
        print(f"{key}: {why}")
    found = f"{len(missing)} private name(s) missing" if missing else f"all {len(NAMES)} private names there"
    print(f"torch {torch.__version__}: {found}")
    return 1 if missing else 0
