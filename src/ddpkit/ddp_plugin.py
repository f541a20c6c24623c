"""The model side of DDP: Lightning 1.x's ``DDPPlugin``, and ``unwrap_model``.

``DDPPlugin`` is what a training loop (ddpkit's ``TrainLoop`` or your own) calls
to set up and drive ``torch.nn.parallel.DistributedDataParallel``. The seed is
Lightning 1.1's plugin; where it relied on Lightning internals that no longer
exist (``LightningDistributedDataParallel``, ``reducer_reset_hooks``), the same
behaviour is built on PyTorch, as each method's docstring says.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.optim import Optimizer

from ddpkit._activations import ActivationCheckpointingPolicy, checked_policy, checkpoint_activations
from ddpkit._torch_private import inner_of_compiled
from ddpkit.batches import iter_tensors, move_data_to_device
from ddpkit.checkpoint import load_sharded
from ddpkit.process_group import (
    SupportsClusterEnvironment,
    SupportsMainAddress,
    ensure_dist_connection,
    get_rank,
    init_dist_connection,
    is_distributed,
    main_address_and_port,
)

__all__ = ["DDPPlugin", "unwrap_model"]


class DDPPlugin:
    """Links a DDP implementation to a training loop (Lightning 1.x's ``DDPPlugin``).

    All constructor arguments but ``activation_checkpointing_policy`` are
    forwarded to ``torch.nn.parallel.DistributedDataParallel``
    (``find_unused_parameters`` defaults to ``False``). Subclass it and override
    :meth:`configure_ddp` for a custom wrapper.

    Args:
        activation_checkpointing_policy: which submodules keep only their inputs
            in the forward and compute their activations again in the backward
            (Lightning's argument of that name): a set of module classes (e.g.
            ``{TransformerBlock}``), a callable ``module -> bool``, or torch's
            auto-wrap policy ``(module, recurse, nonwrapped_numel) -> bool``;
            each is wrapped in torch's non-reentrant ``checkpoint_wrapper``
            (see :meth:`apply_activation_checkpointing`). Default ``None``: none.
        kwargs: ``DistributedDataParallel``'s.

    Raises:
        TypeError: ``activation_checkpointing_policy`` is neither module classes nor a callable.

    Example:
        >>> plugin = DDPPlugin(gradient_as_bucket_view=True)
        >>> model = plugin.configure_ddp(model, device_ids=None)   # CPU; [local_rank] on a GPU
    """

    #: Whether every forward and backward is a collective that every rank must run as often as the others (a
    #: sharded model's, ``FSDPPlugin``); DDP's forwards are each rank's own.
    forwards_together = False
    #: The training loop's precision (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``), which a ``TrainLoop`` sets
    #: before :meth:`configure_ddp`: ``FSDPPlugin`` shards in bf16 for ``"bf16-mixed"``; DDP does not use it.
    precision = "32"

    def __init__(self, activation_checkpointing_policy: ActivationCheckpointingPolicy | None = None, **kwargs: Any
                 ) -> None:  # fmt: skip
        self._ddp_kwargs: dict[str, Any] = kwargs
        self.device_ids: list[int] | None = None
        self.activation_checkpointing_policy = checked_policy(activation_checkpointing_policy)

    def apply_activation_checkpointing(self, model: nn.Module) -> list[str]:
        """Wrap each submodule of ``model`` that ``activation_checkpointing_policy`` chooses (the outermost ones)
        in torch's non-reentrant ``checkpoint_wrapper``, in place, once; the names of those wrapped (``[]``
        without a policy). Its forward then keeps only its inputs, and its backward runs its forward again:
        less memory for activations, about one more forward of compute; the gradients equal those without it
        up to rounding (exactly, unless its forward draws random numbers: torch restores the random state).
        ``state_dict`` keys do not change. :meth:`configure_ddp` calls it first; a ``TrainLoop`` in one process
        calls it too.

        Raises:
            ValueError: the policy chose no submodule of ``model``.
        """
        if self.activation_checkpointing_policy is None:
            return []
        return checkpoint_activations(model, self.activation_checkpointing_policy)

    def configure_ddp(self, model: nn.Module, device_ids: list[int] | None) -> DistributedDataParallel:
        """Wrap ``model`` in ``DistributedDataParallel`` with the constructor's arguments.

        The default is ``DistributedDataParallel(model, device_ids=device_ids,
        find_unused_parameters=False, **kwargs)`` (Lightning wrapped a
        ``LightningDistributedDataParallel``; plain DDP is used here). Every rank
        calls it (DDP broadcasts rank 0's parameters and buffers).

        Args:
            model: the module (on its device already).
            device_ids: ``[local_rank]`` for a model on one GPU; ``None`` on CPU.

        Returns:
            The wrapped model.

        In a process that a launcher started as one of several ranks (torchrun,
        ``ddpkit run``, ``srun``, ``mpirun``) the default process group is
        created first if none exists (:func:`~ddpkit.ensure_dist_connection`).

        Raises:
            ValueError: no process group (``DistributedDataParallel`` needs one; the
                message says how to create it).
        """
        if not ensure_dist_connection():
            raise ValueError(
                "configure_ddp wraps the model in DistributedDataParallel, which needs a process group: call "
                "ddpkit.init_dist_connection() first (or run under ddpkit.launch / `ddpkit run`)"
            )
        self._ddp_kwargs["find_unused_parameters"] = self._ddp_kwargs.get("find_unused_parameters", False)
        self.device_ids = device_ids
        self.apply_activation_checkpointing(model)
        return DistributedDataParallel(model, device_ids=device_ids, **self._ddp_kwargs)

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

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's ``state_dict()``.

        A ``ZeroRedundancyOptimizer`` shards its state over the ranks: it is
        consolidated on rank 0 first (every rank must call this then), and rank 0
        gets the full state, the others ``{}``.
        """
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports torch.jit: only when needed

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer.consolidate_state_dict(to=0)
            return optimizer.state_dict() if get_rank() == 0 else {}
        return optimizer.state_dict()

    def checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, directory: Path, name: str, *, asynchronous: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """What a checkpoint holds of the model and its optimizer: ``(weights, optimizer state, sharded)``, the
        model's ``state_dict()`` and :meth:`optimizer_state` (every rank calls it), ``sharded`` ``None``: they go
        in the checkpoint file. (``FSDPPlugin`` writes its shards to ``directory / name`` and says so; with
        ``asynchronous`` it only starts that write, which :meth:`take_pending_write` then hands over.)"""
        return unwrap_model(model).state_dict(), self.optimizer_state(optimizer), None

    def take_pending_write(self) -> Callable[[], object] | None:
        """The write :meth:`checkpoint_state` started with ``asynchronous`` (a callable that waits for it and puts
        it in place: call it from a thread), once; ``None`` when it started none (here: never)."""
        return None

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, weights: dict[str, Any], optimizer_state: dict[str, Any],
        sharded: Path | None,
    ) -> None:  # fmt: skip
        """Load a checkpoint's weights and optimizer state (what :meth:`checkpoint_state` gave): from the file,
        or, for a checkpoint of a sharded run (``sharded``: its directory), each whole tensor read from its
        shards (every rank calls it)."""
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

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole weights, on the CPU (a copy of the unwrapped model's ``state_dict()``). Every rank
        gets them (``FSDPPlugin``'s must be called on every rank, and only rank 0 gets them)."""
        return {name: value.detach().cpu().clone() for name, value in unwrap_model(model).state_dict().items()}

    def on_after_setup_optimizers(self, trainer: object) -> None:
        """Called after the optimizers are set up: a place for RPC configuration or state sharding. Does nothing."""

    def get_model_from_plugin(self, model: nn.Module) -> nn.Module:
        """The module inside the parallel wrapper (the model itself if it is not wrapped)."""
        return unwrap_model(model)

    @contextmanager
    def block_backward_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip DDP's gradient all-reduce in backward passes inside the block (for gradient accumulation).

        Run the forward pass inside the block too: DDP decides at the forward pass
        whether the following backward synchronises, so a forward outside the block
        synchronises anyway. Gradients accumulate locally; the first forward and
        backward outside the block all-reduce the accumulated sum. (Lightning 1.1
        yielded ``model.no_sync()`` without entering it, so its version
        synchronised every time.) Does nothing for a model that is not a
        ``DistributedDataParallel``.

        Example:
            >>> for step, (x, y) in enumerate(micro_batches):
            ...     if step < len(micro_batches) - 1:
            ...         with plugin.block_backward_sync(model):
            ...             loss_fn(model(x), y).backward()
            ...     else:
            ...         loss_fn(model(x), y).backward()   # all-reduces the sum
        """
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield

    def on_before_manual_backward(self, model: nn.Module, output: Any) -> None:
        """Prepare DDP's reducer for a backward pass on ``output``: call it before ``output.backward()``.

        Needed when the loss was computed without calling the DDP model itself
        (e.g. ``model.module.training_step(batch)``): DDP then never armed its
        reducer, and the gradients would silently not be synchronised (measured).
        With ``find_unused_parameters=True`` the reducer is told which tensors the
        output depends on. Harmless after a normal forward through the DDP model.
        Uses DDP's reducer (``model.reducer``), as Lightning 2 does: PyTorch has
        no public API for it.
        """
        if not isinstance(model, DistributedDataParallel):
            return
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            model.require_forward_param_sync = True
            tensors = list(iter_tensors(output)) if model.find_unused_parameters and not model.static_graph else []
            model.reducer._rebuild_buckets()
            model.reducer.prepare_for_backward(tensors)
        else:
            model.require_forward_param_sync = False

    def on_after_manual_backward(self, model: nn.Module) -> None:
        """Called after a manual backward pass; does nothing: PyTorch's DDP has nothing to reset (Lightning 1.1 did)."""

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
