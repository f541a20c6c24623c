"""What the training loop asks of a parallel plugin, and what the plugins share: ``ParallelPlugin`` (Lightning
1.x's name for the parent of its ``DDPPlugin``), and ``unwrap_model``.

``DDPPlugin`` (``DistributedDataParallel``) and ``FSDPPlugin`` (FSDP2's ``fully_shard``) are siblings under
``ParallelPlugin``, as Lightning's DDP and FSDP strategies are under its ``ParallelStrategy``: each implements the
few methods a ``TrainLoop`` calls (:data:`ParallelPlugin.forwards_together`, :meth:`~ParallelPlugin.configure_ddp`,
:meth:`~ParallelPlugin.on_after_setup_optimizers`, :meth:`~ParallelPlugin.block_backward_sync`, the checkpoint's
state in and out, :meth:`~ParallelPlugin.full_state_dict`) with its own reading of them, which its docstrings give;
the rest (activation checkpointing, moving a batch to the model's device, Lightning 1.x's connection and sampler
hooks) is shared here. A training loop never asks which plugin it has.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from ddpkit._activations import ActivationCheckpointingPolicy, checked_policy, checkpoint_activations
from ddpkit._torch_private import inner_of_compiled
from ddpkit.batches import move_data_to_device
from ddpkit.checkpoint import load_sharded
from ddpkit.process_group import (
    SupportsClusterEnvironment,
    SupportsMainAddress,
    init_dist_connection,
    is_distributed,
    main_address_and_port,
)

__all__ = ["ParallelPlugin", "load_whole_or_sharded", "unwrap_model", "whole_state_dict"]


class ParallelPlugin(ABC):
    """The parent of ``DDPPlugin`` and ``FSDPPlugin`` (Lightning 1.x's ``ParallelPlugin``): what a training loop
    calls on either, and the hooks they share.

    A ``TrainLoop`` calls, in order: :meth:`configure_ddp` on every rank (after setting :attr:`precision`), then
    :meth:`on_after_setup_optimizers` once its optimizer exists (required: a sharding plugin points the optimizer
    at the shards there), :meth:`block_backward_sync` around the micro-batches of a step but its last,
    :meth:`checkpoint_state` and :meth:`load_checkpoint_state` for checkpoints (and :meth:`take_pending_write` for
    one written in the background), and :meth:`full_state_dict` for the whole weights. Subclass one of the two
    plugins rather than this class.

    Args:
        activation_checkpointing_policy: which submodules keep only their inputs
            in the forward and compute their activations again in the backward
            (Lightning's argument of that name): a set of module classes (e.g.
            ``{TransformerBlock}``), a callable ``module -> bool``, or torch's
            auto-wrap policy ``(module, recurse, nonwrapped_numel) -> bool``;
            each is wrapped in torch's non-reentrant ``checkpoint_wrapper``
            (see :meth:`apply_activation_checkpointing`). Default ``None``: none.

    Raises:
        TypeError: ``activation_checkpointing_policy`` is neither module classes nor a callable.
    """

    #: Whether every forward and backward is a collective that every rank must run as often as the others (a
    #: sharded model's, ``FSDPPlugin``); DDP's forwards are each rank's own.
    forwards_together = False
    #: The training loop's precision (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``), which a ``TrainLoop`` sets
    #: before :meth:`configure_ddp`: ``FSDPPlugin`` shards in bf16 for ``"bf16-mixed"``; DDP does not use it.
    precision = "32"

    def __init__(self, activation_checkpointing_policy: ActivationCheckpointingPolicy | None = None) -> None:
        self.device_ids: list[int] | None = None
        self.activation_checkpointing_policy = checked_policy(activation_checkpointing_policy)

    # --- what a training loop calls, each plugin its own way ---------------------------------------

    @abstractmethod
    def configure_ddp(self, model: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """Make ``model`` parallel (wrap it, or shard it in place) and return the module to train; every rank
        calls it, with the model on its device (``device_ids``: ``[local_rank]`` on a GPU, ``None`` on CPU).

        Raises:
            ValueError: no process group (the message says how to create one).
        """

    @abstractmethod
    def on_after_setup_optimizers(self, trainer: object) -> None:
        """Called once the loop's optimizer (``trainer.optimizer``) exists, after :meth:`configure_ddp`: where a
        plugin adapts the optimizer to the model it made (``FSDPPlugin`` points it at the shards)."""

    @abstractmethod
    def block_backward_sync(self, model: nn.Module) -> AbstractContextManager[None]:
        """A block whose backward passes (and their forwards) accumulate gradients without reducing them across
        ranks (gradient accumulation); the first backward after it reduces the accumulated sum."""

    @abstractmethod
    def checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, directory: Path | None, name: str, *, asynchronous: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """What a checkpoint holds of the model and its optimizer, ``(weights, optimizer state, sharded)``: the
        state dicts that go in the checkpoint file, or ``({}, {}, name)`` when they were written as the sharded
        checkpoint ``directory / name`` (with ``asynchronous``, started; :meth:`take_pending_write` hands the
        write over). ``directory`` ``None``: the state is wanted in memory (what a recovering fault-tolerant
        replica group takes: a sharded plugin gives this rank's shards), and a plugin that can only write it
        raises ``ValueError``. Every rank calls it."""

    def take_pending_write(self) -> Callable[[], object] | None:
        """The write :meth:`checkpoint_state` started with ``asynchronous`` (a callable that waits for it and puts
        it in place: call it from a thread), once; ``None`` when it started none."""
        return None

    @abstractmethod
    def load_checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, weights: dict[str, Any], optimizer_state: dict[str, Any],
        sharded: Path | None,
    ) -> None:  # fmt: skip
        """Load what :meth:`checkpoint_state` gave (of this plugin or another: a checkpoint resumes under
        either): the state dicts, or the sharded checkpoint in the directory ``sharded``. Every rank calls it."""

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole weights on the CPU, by ``state_dict`` name. Every rank calls it; which ranks get
        them is the plugin's (``DDPPlugin``: every rank; ``FSDPPlugin``: rank 0, the others ``{}``)."""

    # --- shared by every plugin -----------------------------------------------------------------

    def apply_activation_checkpointing(self, model: nn.Module) -> list[str]:
        """Wrap each submodule of ``model`` that ``activation_checkpointing_policy`` chooses (the outermost ones)
        in torch's non-reentrant ``checkpoint_wrapper``, in place, once; the names of those wrapped (``[]``
        without a policy). Its forward then keeps only its inputs, and its backward runs its forward again:
        less memory for activations, about one more forward of compute; the gradients equal those without it
        up to rounding (exactly, unless its forward draws random numbers: torch restores the random state).
        ``state_dict`` keys do not change. Each plugin's :meth:`configure_ddp` calls it first; a ``TrainLoop`` in one
        process calls it too.

        Raises:
            ValueError: the policy chose no submodule of ``model``.
        """
        if self.activation_checkpointing_policy is None:
            return []
        return checkpoint_activations(model, self.activation_checkpointing_policy)

    def init_ddp_connection(
        self,
        trainer: object,
        cluster_environment: SupportsClusterEnvironment | SupportsMainAddress,
        global_rank: int,
        world_size: int,
        is_slurm_managing_tasks: bool = True,
    ) -> None:
        """Set ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` and initialise the default process group.

        On top of :func:`~ddpkit.init_dist_connection` (idempotent). The backend is
        ``nccl`` when ``trainer.on_gpu`` is true, ``gloo`` when it is false, and
        chosen automatically when ``trainer`` has no ``on_gpu`` (or is ``None``).
        ``is_slurm_managing_tasks`` is accepted for Lightning 1.x's signature; the
        cluster environment (Lightning 1.x's with ``master_address()`` or 2.x's
        with ``main_address``) already says where the process sits. Every rank
        calls it.

        Args:
            trainer: anything with ``on_gpu`` (or ``None``).
            cluster_environment: ddpkit's, Lightning's, or any object with their methods.
            global_rank: this process's rank in ``[0, world_size)``.
            world_size: the number of processes.
            is_slurm_managing_tasks: accepted and unused.

        Raises:
            As :func:`~ddpkit.init_dist_connection`: ``ValueError`` for a bad rank
            or backend, ``ClusterEnvironmentError`` for an address that does not
            resolve, ``TypeError`` for something that is not a cluster environment.
        """
        address, port = main_address_and_port(cluster_environment)
        os.environ["MASTER_ADDR"] = address
        os.environ["MASTER_PORT"] = str(port)
        os.environ["WORLD_SIZE"] = str(cluster_environment.world_size())
        on_gpu = getattr(trainer, "on_gpu", None)
        backend = None if on_gpu is None else ("nccl" if on_gpu else "gloo")
        init_dist_connection(cluster_environment, backend, global_rank, world_size)

    @property
    def is_running_single_process_per_device(self) -> bool:
        """True when the wrapped model has exactly one device id (one process per GPU)."""
        return self.device_ids is not None and len(self.device_ids) == 1

    def on_before_forward(self, model: nn.Module, *args: Any) -> tuple[Any, ...]:
        """``args`` moved to the model's device (nested dicts, lists, tuples, namedtuples, dataclasses).

        Lightning moved them only with one process per device, through the
        LightningModule's ``transfer_batch_to_device``; this moves every tensor
        that is not on the model's device yet, for any module.

        Returns:
            The (moved) arguments, as a tuple.
        """
        # DDP keeps its module's device (it cannot move once wrapped): no walk through the modules each step.
        device = getattr(model, "device", None) if isinstance(model, DistributedDataParallel) else None
        device = device if isinstance(device, torch.device) else _device_of(model)
        if device is None:
            return args
        if len(args) == 1 and isinstance(args[0], torch.Tensor):  # one batch tensor, the common call
            return (args[0] if args[0].device == device else move_data_to_device(args[0], device),)
        return tuple(move_data_to_device(arg, device) for arg in args)

    def get_model_from_plugin(self, model: nn.Module) -> nn.Module:
        """The module inside the parallel wrapper (the model itself if it is not wrapped)."""
        return unwrap_model(model)

    def on_after_manual_backward(self, model: nn.Module) -> None:
        """Called after a manual backward pass; does nothing: PyTorch's DDP has nothing to reset (Lightning 1.1 did)."""
        return

    def distributed_sampler_kwargs(self, distributed_sampler_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Lightning 1.x's hook to change the arguments of the trainer's ``DistributedSampler``: returns them as given.

        Override it to change them; ``num_replicas`` and ``rank`` come from the
        caller (e.g. ``{"num_replicas": get_world_size(), "rank": get_rank()}``).
        """
        return distributed_sampler_kwargs

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The process group this process trains in, the whole world (``None`` without a process group)."""
        return dist.group.WORLD if is_distributed() else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel``, ``DataParallel`` and ``torch.compile`` wrappers, nested or not."""
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif (inner := inner_of_compiled(model)) is not None:  # torch.compile
            model = inner
        else:
            return model


def _device_of(model: nn.Module) -> torch.device | None:
    """The device of ``model``'s first parameter (else first buffer), as ``next(model.parameters())`` finds it,
    walked without generators: this runs before every forward."""
    tensor = _first(model, "_parameters")
    if tensor is None:
        tensor = _first(model, "_buffers")
    return tensor.device if tensor is not None else None


def _first(module: nn.Module, kind: str) -> torch.Tensor | None:
    """The first tensor of ``module``'s own ``kind`` (``_parameters`` or ``_buffers``), else its submodules', in
    the order ``Module.named_parameters`` yields them (the module, then each submodule depth first)."""
    for tensor in getattr(module, kind).values():
        if tensor is not None:
            return tensor  # type: ignore[no-any-return]
    for child in module._modules.values():
        if child is not None and (found := _first(child, kind)) is not None:
            return found
    return None


def whole_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the unwrapped model's ``state_dict()``."""
    return {name: value.detach().cpu().clone() for name, value in unwrap_model(model).state_dict().items()}


def load_whole_or_sharded(
    model: nn.Module, optimizer: Optimizer, weights: dict[str, Any], optimizer_state: dict[str, Any],
    sharded: Path | None,
) -> None:  # fmt: skip
    """Load whole state dicts into the (unwrapped) model and its optimizer, or, with ``sharded`` (a sharded
    checkpoint's directory), each whole tensor read from its shards (every rank calls it)."""
    module = unwrap_model(model)
    if sharded is None:
        module.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    current_weights, current_optimizer = get_state_dict(module, optimizer)
    state: dict[str, Any] = {"model": current_weights, "optimizer": current_optimizer}
    load_sharded(state, sharded)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
