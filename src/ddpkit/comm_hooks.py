"""Register DDP communication hooks by object or by name, checked up front (Lightning's ``register_ddp_comm_hook``).

Built on ``torch.distributed.algorithms.ddp_comm_hooks``. What ddpkit adds:
names (``"fp16"``, ``"powersgd"``, ...) with sensible default states, and checks
at registration instead of a crash at the first backward: the model is a
``DistributedDataParallel``, the state has the type the hook expects, the
backend can all-reduce the compression dtype on the parameters' device,
post-local-SGD gets a subgroup that exists for a CPU model too, and PowerSGD is
refused for a CPU model on a machine with a GPU (torch's hook would crash).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local_sgd
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd
from torch.nn.parallel import DistributedDataParallel

from ddpkit._torch_private import private
from ddpkit.collectives._codec import dtype_name
from ddpkit.errors import DDPKitError

__all__ = [
    "HOOKS",
    "WRAPPERS",
    "HookName",
    "WrapperName",
    "batched_powersgd_works",
    "bf16_supported",
    "register_ddp_comm_hook",
]

log = logging.getLogger(__name__)

HookName = Literal["allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "post_localsgd"]
WrapperName = Literal["fp16", "bf16"]
Hook = Callable[[Any, Any], Any]  # hook(state, bucket: dist.GradBucket) -> torch.futures.Future

#: Hook names and the torch hooks they stand for.
HOOKS: dict[str, Hook] = {
    "allreduce": default.allreduce_hook,
    "fp16": default.fp16_compress_hook,
    "bf16": default.bf16_compress_hook,
    "powersgd": power_sgd.powerSGD_hook,
    "batched_powersgd": power_sgd.batched_powerSGD_hook,
    "post_localsgd": post_local_sgd.post_localSGD_hook,
}
#: Wrapper names and the torch wrappers they stand for.
WRAPPERS: dict[str, Callable[[Hook], Hook]] = {
    "fp16": default.fp16_compress_wrapper,
    "bf16": default.bf16_compress_wrapper,
}
_PROCESS_GROUP_STATE = (default.allreduce_hook, default.fp16_compress_hook, default.bf16_compress_hook)
_POWER_SGD = (power_sgd.powerSGD_hook, power_sgd.batched_powerSGD_hook)
_DTYPES: dict[Any, torch.dtype] = {
    default.fp16_compress_hook: torch.float16,
    default.bf16_compress_hook: torch.bfloat16,
    default.fp16_compress_wrapper: torch.float16,
    default.bf16_compress_wrapper: torch.bfloat16,
}


def register_ddp_comm_hook(
    model: DistributedDataParallel,
    ddp_comm_state: object | None = None,
    ddp_comm_hook: Hook | HookName | None = None,
    ddp_comm_wrapper: Callable[[Hook], Hook] | WrapperName | None = None,
    *,
    state: object | None = None,
) -> None:
    """Register a communication hook on a DDP model (Lightning's function); every rank must call it, alike.

    Args:
        model: the ``DistributedDataParallel`` model.
        ddp_comm_state: the hook's state (e.g. ``PowerSGDState``, ``PostLocalSGDState``,
            or a process group for the default hooks). For a hook given by name,
            ``None`` means a default: the whole world for ``"allreduce"``,
            ``"fp16"``, ``"bf16"``; ``PowerSGDState(process_group=None)`` (rank 1,
            compression from iteration 1000) for the PowerSGD hooks;
            ``PostLocalSGDState`` with a subgroup per node and local SGD from
            iteration 1000 for ``"post_localsgd"``.
        ddp_comm_hook: ``hook(state, bucket) -> Future``, or one of
            ``"allreduce"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``,
            ``"batched_powersgd"``, ``"post_localsgd"``. ``None`` registers nothing.
        ddp_comm_wrapper: a wrapper such as ``fp16_compress_wrapper`` that
            compresses around the hook, or ``"fp16"``/``"bf16"``.
        state: the same as ``ddp_comm_state`` (the post-local-SGD example in
            Lightning's documentation of this function passes it so).

    Post-local SGD also needs a model averager after ``optimizer.step()``
    (``torch.distributed.algorithms.model_averaging.averagers.PeriodicModelAverager``).

    Raises:
        ValueError: an unknown hook or wrapper name (the message lists them), or a
            wrapper without a hook.
        TypeError: ``model`` is not a ``DistributedDataParallel``, a hook or
            wrapper with the wrong signature, or a state of the wrong type for the
            hook (e.g. a process group where PowerSGD needs a ``PowerSGDState``).
        DDPKitError: the hook cannot run here (bf16 compression needs CUDA with
            NCCL 2.10+, or XPU with XCCL: not gloo; torch 2.13's
            ``batched_powerSGD_hook`` is broken; torch's PowerSGD hooks call
            ``torch.cuda.synchronize`` on the gradients' device whenever CUDA
            is available, so they crash for a CPU model on a machine with a
            GPU), the backend cannot all-reduce
            the compression dtype on the parameters' device, or a hook was already
            registered on this model.
    """
    if state is not None:
        if ddp_comm_state is not None:
            raise TypeError("pass the hook's state once: either ddp_comm_state= or state=")
        ddp_comm_state = state
    if ddp_comm_hook is None:
        if ddp_comm_wrapper is not None:
            raise ValueError("ddp_comm_wrapper wraps a hook: pass ddp_comm_hook too (e.g. 'powersgd')")
        return
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_ddp_comm_hook needs a DistributedDataParallel model, got {type(model).__name__}")
    hook = _resolve(ddp_comm_hook, HOOKS, "hook")
    wrapper = _resolve(ddp_comm_wrapper, WRAPPERS, "wrapper") if ddp_comm_wrapper is not None else None
    _check_arity(hook, 2, "ddp_comm_hook", "hook(state, bucket)")
    if wrapper is not None:
        _check_arity(wrapper, 1, "ddp_comm_wrapper", "wrapper(hook)")
    if default.bf16_compress_hook in (hook, wrapper) or default.bf16_compress_wrapper in (hook, wrapper):
        _check_bf16_supported()
    if hook is power_sgd.batched_powerSGD_hook and not batched_powersgd_works():
        raise DDPKitError(
            f"torch {torch.__version__}'s batched_powerSGD_hook fails at its first compressed step (it hands a 2-D "
            "matrix to _orthogonalize, which needs a batch of matrices); use 'powersgd', or a torch where it is fixed"
        )
    device = _parameter_device(model)
    hook_state = _state_for(hook, ddp_comm_state, device)
    if hook in _POWER_SGD and device.type == "cpu" and torch.cuda.is_available():
        raise DDPKitError(
            f"torch's {hook.__qualname__} calls torch.cuda.synchronize() on the gradients' device whenever CUDA is "
            "available, and this model's parameters are on the CPU of a machine with a GPU: it would crash at its "
            "first compressed step. Put the model on its GPU (backend 'nccl'), or hide the GPU from this CPU job "
            "(CUDA_VISIBLE_DEVICES='' before the job starts)"
        )
    for part in (hook, wrapper):
        if part in _DTYPES:
            _probe_backend(model, _DTYPES[part], hook_state)
    final = wrapper(hook) if wrapper is not None else hook
    log.debug("registering DDP comm hook %s", getattr(final, "__qualname__", final))
    try:
        model.register_comm_hook(state=hook_state, hook=final)
    except RuntimeError as exc:
        raise DDPKitError(f"could not register the comm hook: {exc} (a DDP model takes one hook, once)") from exc


def _resolve(value: Any, table: dict[str, Any], kind: str) -> Any:
    if isinstance(value, str):
        if value not in table:
            raise ValueError(f"unknown comm {kind} name {value!r}; use one of {', '.join(repr(n) for n in table)}")
        return table[value]
    if not callable(value):
        raise TypeError(f"ddp_comm_{kind} must be callable or a name, got {type(value).__name__}")
    return value


def _check_arity(fn: Callable[..., Any], count: int, name: str, shape: str) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: let torch judge
        return
    try:
        signature.bind(*([None] * count))
    except TypeError:
        raise TypeError(
            f"{name} must be callable as {shape}; {getattr(fn, '__qualname__', fn)}{signature} is not"
        ) from None


def _parameter_device(model: DistributedDataParallel) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _state_for(hook: Any, given: object | None, device: torch.device) -> object | None:
    """The state to register ``hook`` with: ``given`` (checked), or a default for known hooks."""
    if hook in _PROCESS_GROUP_STATE:
        if given is not None and not isinstance(given, dist.ProcessGroup):
            raise TypeError(
                f"{hook.__qualname__} takes a process group (or None for the whole world) as its state, "
                f"got {type(given).__name__}"
            )
        return given
    if hook in _POWER_SGD:
        if given is None:
            return power_sgd.PowerSGDState(process_group=None)
        if not isinstance(given, power_sgd.PowerSGDState):
            raise TypeError(f"{hook.__qualname__} needs a PowerSGDState as its state, got {type(given).__name__}")
        return given
    if hook is post_local_sgd.post_localSGD_hook:
        if given is None:
            given = post_local_sgd.PostLocalSGDState(  # type: ignore[no-untyped-call]
                process_group=None, subgroup=None, start_localSGD_iter=1_000
            )
        if not isinstance(given, post_local_sgd.PostLocalSGDState):
            raise TypeError(f"post_localSGD_hook needs a PostLocalSGDState as its state, got {type(given).__name__}")
        if given.subgroup is None and device.type != "cuda":
            # torch would create it at the first backward after start_localSGD_iter with new_subgroups(),
            # sized by the CUDA device count: a crash on a machine without a GPU, and on one with a GPU a
            # subgroup per GPU (no averaging at all for a CPU model beside one GPU). One per node, now.
            world = dist.get_world_size()
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            size = per_node if world % per_node == 0 else world
            given.subgroup, _ = dist.new_subgroups(group_size=size)  # type: ignore[no-untyped-call]
        return given
    return given


def bf16_supported() -> bool:
    """Whether PyTorch's DDP runs bf16 compression here: CUDA with NCCL 2.10+, or XPU with XCCL.

    (DDP refuses the bf16 hooks everywhere else, gloo included, even where gloo
    itself could all-reduce bfloat16.)
    """
    cuda_nccl = (torch.version.cuda is not None or torch.version.hip is not None) and dist.is_nccl_available()
    if cuda_nccl and torch.cuda.nccl.version() >= (2, 10):  # type: ignore[no-untyped-call]
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(getattr(dist, "is_xccl_available", lambda: False)() and xpu is not None and xpu.is_available())


def batched_powersgd_works() -> bool:
    """Whether this torch's ``batched_powerSGD_hook`` can run: torch 2.13's calls ``_orthogonalize`` on a 2-D
    matrix, which only accepts a batch of matrices, and fails at its first compressed step."""
    try:
        private("powersgd_orthogonalize")(torch.ones(4, 1))
    except AssertionError:
        return False
    return True


def _check_bf16_supported() -> None:
    if not bf16_supported():
        raise DDPKitError(
            f"bf16 compression needs CUDA with NCCL 2.10+ (or XPU with XCCL); this process group uses "
            f"{dist.get_backend()} and PyTorch's DDP refuses it there. Use 'fp16' instead"
        )


def _probe_backend(model: DistributedDataParallel, dtype: torch.dtype, state: object | None) -> None:
    """All-reduce one element of ``dtype`` on the parameters' device: the backend can, or a clear error."""
    device = _parameter_device(model)
    group = state if isinstance(state, dist.ProcessGroup) else getattr(state, "process_group", None)
    backend = dist.get_backend(group)
    try:
        dist.all_reduce(torch.ones(1, dtype=dtype, device=device), group=group)
    except RuntimeError as exc:
        raise DDPKitError(
            f"the {backend} backend cannot all-reduce {dtype_name(dtype)} tensors on {device.type}, which this hook "
            f"sends ({exc}); use 'allreduce' or a compression the backend supports"
        ) from exc
