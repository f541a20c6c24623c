"""The model side of DDP: Lightning 1.x's ``DDPPlugin`` (and ``unwrap_model``, from ``parallel_plugin``).

``DDPPlugin`` is what a training loop (ddpkit's ``TrainLoop`` or your own) calls
to set up and drive ``torch.nn.parallel.DistributedDataParallel``. The seed is
Lightning 1.1's plugin; where it relied on Lightning internals that no longer
exist (``LightningDistributedDataParallel``, ``reducer_reset_hooks``), the same
behaviour is built on PyTorch, as each method's docstring says.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ddpkit._activations import ActivationCheckpointingPolicy
from ddpkit._torch_private import private
from ddpkit.batches import iter_tensors
from ddpkit.parallel_plugin import ParallelPlugin, load_whole_or_sharded, unwrap_model, whole_state_dict
from ddpkit.process_group import (
    ensure_dist_connection,
    get_rank,
)

__all__ = ["DDPPlugin", "unwrap_model"]


class DDPPlugin(ParallelPlugin):
    """Links a DDP implementation to a training loop (Lightning 1.x's ``DDPPlugin``).

    All constructor arguments but ``activation_checkpointing_policy`` are
    forwarded to ``torch.nn.parallel.DistributedDataParallel``
    (``find_unused_parameters`` defaults to ``False``). Subclass it and override
    :meth:`configure_ddp` for a custom wrapper.

    Args:
        activation_checkpointing_policy: which submodules compute their
            activations again in the backward instead of keeping them
            (Lightning's argument of that name), as for :class:`~ddpkit.ParallelPlugin`.
            Default ``None``: none.
        kwargs: ``DistributedDataParallel``'s.

    Raises:
        TypeError: ``activation_checkpointing_policy`` is neither module classes nor a callable.

    Example:
        >>> plugin = DDPPlugin(gradient_as_bucket_view=True)
        >>> model = plugin.configure_ddp(model, device_ids=None)   # CPU; [local_rank] on a GPU
    """

    def __init__(self, activation_checkpointing_policy: ActivationCheckpointingPolicy | None = None, **kwargs: Any
                 ) -> None:  # fmt: skip
        super().__init__(activation_checkpointing_policy)
        self._ddp_kwargs: dict[str, Any] = kwargs

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
        self, model: nn.Module, optimizer: Optimizer, directory: Path | None, name: str, *, asynchronous: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """What a checkpoint holds of the model and its optimizer: ``(weights, optimizer state, None)``, the
        model's ``state_dict()`` and :meth:`optimizer_state`, which go in the checkpoint file (``directory``,
        ``name`` and ``asynchronous`` are a sharding plugin's). Every rank calls it."""
        return unwrap_model(model).state_dict(), self.optimizer_state(optimizer), None

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, weights: dict[str, Any], optimizer_state: dict[str, Any],
        sharded: Path | None,
    ) -> None:  # fmt: skip
        """Load a checkpoint's weights and optimizer state (what :meth:`checkpoint_state` gave): from the file,
        or, for a checkpoint of a sharded run (``sharded``: its directory), each whole tensor read from its
        shards (every rank calls it)."""
        load_whole_or_sharded(model, optimizer, weights, optimizer_state, sharded)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole weights, on the CPU (a copy of the unwrapped model's ``state_dict()``); every rank
        gets them."""
        return whole_state_dict(model)

    def on_after_setup_optimizers(self, trainer: object) -> None:
        """Called after the optimizers are set up: a place for RPC configuration or state sharding. Does nothing
        (DDP's optimizer steps the whole parameters)."""
        return

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
            private("ddp_rebuild_buckets")(model.reducer)
            model.reducer.prepare_for_backward(tensors)
        else:
            model.require_forward_param_sync = False
