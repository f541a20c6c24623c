"""The model side of sharded training: ``FSDPPlugin``, torch's FSDP2 (``fully_shard``), a sibling of ``DDPPlugin``.

With ``TrainLoop(..., plugin=ddpkit.FSDPPlugin())`` every rank holds ``1/W``
of each weight, of its gradient and of its optimizer state (as ``DTensor``
shards); each unit (a block of the model) gathers its full weights for its
forward and backward and reduce-scatters its gradients, so a model that does
not fit one device's memory three times over still trains. Everything else a
``TrainLoop`` does (the steps of a global batch on any world size, exact
evaluation, clipping, precision, checkpoints resumed on another world size)
holds as with DDP: the loop asks the plugin, never which plugin it has.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from tqdm import tqdm

from ddpkit._activations import ActivationCheckpointingPolicy
from ddpkit._fsdp_units import WrapPolicy, choose_units, mark_units, units_source, units_text
from ddpkit._local_shards import is_local_shards, load_local_shards, local_shards
from ddpkit.checkpoint import save_sharded, start_saving_sharded
from ddpkit.environments import detect_environment
from ddpkit.parallel_plugin import ParallelPlugin, load_whole_or_sharded, unwrap_model, whole_state_dict
from ddpkit.process_group import ensure_dist_connection, get_rank, get_world_size, is_distributed

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDPPlugin"]


class FSDPPlugin(ParallelPlugin):
    """Shards the model over the ranks with torch's FSDP2 ``fully_shard`` (Lightning's ``FSDPStrategy``,
    Accelerate's ``FullyShardedDataParallelPlugin`` with ``fsdp_version=2``): ``DDPPlugin``'s sibling, called by a
    training loop where it calls ``DDPPlugin``.

    Each unit chosen by ``auto_wrap_policy`` is ``fully_shard``-ed, then the
    whole model (its leftover parameters); ``fully_shard`` replaces the
    parameters with ``DTensor`` shards, and :meth:`on_after_setup_optimizers`
    points the loop's optimizer at them (same object, class, hyperparameters
    and parameter groups), so an optimizer built on the unsharded model (the
    loop's default Adam too) trains the shards. In one process nothing is
    sharded: the model trains as it is.

    Args:
        auto_wrap_policy: which submodules are units of their own (each gathers
            its full weights only while it computes): a set of module classes
            (e.g. ``{TransformerBlock}``), or a callable ``module -> bool``. Default:
            the modules the model names in ``_no_split_modules`` (transformers'
            list of its blocks, e.g. ``GPT2Block``) when it has some, else every
            child with parameters of the outermost ``nn.Sequential`` or
            ``nn.ModuleList`` on each path from the model down (the layers of a
            stack, the blocks of a transformer; not the layers inside a block).
            :meth:`units` lists them, and rank 0 prints them when it shards.
        reshard_after_forward: free each unit's full weights after its forward
            and gather them again for its backward (torch's default, ``True``);
            ``False`` keeps them until the backward (less communication, more memory).
        mp_policy: torch's ``MixedPrecisionPolicy``; default: with the loop's
            ``precision="bf16-mixed"``, ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32)`` (each unit gathers its weights and
            computes in bf16, gradients are reduced and the weights and optimizer
            kept in float32, as Lightning's FSDP does for ``bf16-mixed``), else
            none (float32; the loop's autocast as with DDP).
        offload_policy: torch's ``CPUOffloadPolicy`` to keep the shards on the CPU between uses; default none.
        hsdp: shard inside each node and replicate across nodes (a 2-D device
            mesh ``(nodes, processes per node)``: HSDP), for jobs of several nodes
            whose model fits one node's devices; an int shards over groups of that
            many ranks instead of a node's; default ``False`` (shard over all ranks).
        activation_checkpointing_policy: which submodules compute their
            activations again in the backward instead of keeping them (Lightning's
            argument of that name): module classes, a callable ``module -> bool``
            or torch's auto-wrap policy; applied before sharding (as torchtitan
            does), see :meth:`~ddpkit.DDPPlugin.apply_activation_checkpointing`.
            Default ``None``: none.

    Raises:
        TypeError: ``auto_wrap_policy`` or ``activation_checkpointing_policy`` is neither module classes nor a
            callable.

    Example:
        >>> loop = TrainLoop(model, loader, plugin=FSDPPlugin(auto_wrap_policy={Block}), global_batch_size=64)
        >>> loop.fit(3)                   # under `ddpkit run -n 2` (or torchrun, srun, fit_distributed)
        >>> weights = loop.full_state_dict()   # every rank calls it; rank 0 gets the full weights
    """

    #: Every forward and backward of a sharded model is a collective (each unit gathers its weights), so
    #: every rank runs as many as the others (the loop gives a rank with fewer batches ones that count nothing).
    forwards_together = True

    def __init__(
        self,
        auto_wrap_policy: WrapPolicy | None = None,
        *,
        reshard_after_forward: bool = True,
        mp_policy: Any = None,
        offload_policy: Any = None,
        hsdp: bool | int = False,
        activation_checkpointing_policy: ActivationCheckpointingPolicy | None = None,
    ) -> None:
        super().__init__(activation_checkpointing_policy)
        if auto_wrap_policy is not None and not callable(auto_wrap_policy):
            classes = tuple(auto_wrap_policy)
            if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
                raise TypeError(
                    f"auto_wrap_policy={auto_wrap_policy!r}: give nn.Module classes (e.g. {{TransformerBlock}}) or a "
                    "callable module -> bool"
                )
        self.auto_wrap_policy = auto_wrap_policy
        self.reshard_after_forward = reshard_after_forward
        self.mp_policy, self.offload_policy = mp_policy, offload_policy
        self.hsdp = hsdp
        self._sharded: nn.Module | None = None  # the model configure_ddp sharded, and its sharded parameters:
        self._shards: dict[str, nn.Parameter] = {}  # FSDP swaps a computing unit's whole ones into its modules
        self._unsharded: dict[int, tuple[torch.Tensor, str]] = {}  # its parameters before, by id, with names
        self._checkpoint_group: Any = None  # async checkpoints' gloo group, once made
        self._pending_write: Callable[[], object] | None = None  # what checkpoint_state(asynchronous=True) started

    # --- the model ---------------------------------------------------------------------------------

    def configure_ddp(self, model: nn.Module, device_ids: list[int] | None) -> nn.Module:
        """``fully_shard`` each unit of ``model``, then ``model`` itself, in place; returns ``model`` (now also an
        ``FSDPModule``). Every rank calls it, with the model on its device (``device_ids``: ``[local_rank]`` on
        a GPU, ``None`` on CPU). Rank 0's weights are what every rank starts from (as DDP broadcasts them).

        Raises:
            ValueError: no process group; the model's parameters are on several devices; ``hsdp`` with a world
                size that the processes per node do not divide.
        """
        from torch.distributed.fsdp import fully_shard

        if not ensure_dist_connection():
            raise ValueError(
                "FSDPPlugin shards the model over a process group: call ddpkit.init_dist_connection() first (or run "
                "under ddpkit.launch / `ddpkit run`)"
            )
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            raise ValueError(
                f"FSDPPlugin: the model's parameters are on {sorted(map(str, devices))}; fully_shard shards a model "
                "on one device per rank: move it with model.to(device) first"
            )
        self.device_ids = device_ids
        self.apply_activation_checkpointing(model)
        mesh = self._mesh(device_ids)
        self._unsharded = {id(p): (p, name) for name, p in model.named_parameters()}
        options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward}
        mp_policy = self.mp_policy
        if mp_policy is None and self.precision == "bf16-mixed":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mp_policy is not None:
            options["mp_policy"] = mp_policy
        if self.offload_policy is not None:
            options["offload_policy"] = self.offload_policy
        _broadcast_from_rank_zero(model)
        units = choose_units(model, self.auto_wrap_policy)
        if get_rank() == 0:
            tqdm.write(f"FSDPPlugin: {units_text(model, units, units_source(model, self.auto_wrap_policy))}\n", end="")
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        mark_units(model)
        self._sharded, self._shards = model, dict(model.named_parameters())
        return model

    def _mesh(self, device_ids: list[int] | None) -> DeviceMesh:
        """The device mesh to shard over: all ranks, or ``(nodes, processes per node)`` for HSDP."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if device_ids else "cpu"
        world = get_world_size()
        if not self.hsdp:
            return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        per_node = self.hsdp if self.hsdp is not True else detect_environment().local_world_size() or world
        if not 0 < per_node <= world or world % per_node:
            raise ValueError(
                f"FSDPPlugin(hsdp={self.hsdp}): {world} ranks are not whole groups of {per_node}; run the same "
                "number of processes on every node, or pass hsdp=False"
            )
        return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))

    def units(self, model: nn.Module) -> list[str]:
        """The names (as ``model.named_modules()`` gives them, in its order) of the submodules that are units of
        their own, as ``auto_wrap_policy`` or the default chooses them; the whole model is one too, for the
        parameters they leave (not listed). A model already sharded or wrapped is looked through."""
        model = unwrap_model(model)
        chosen = {id(unit) for unit in choose_units(model, self.auto_wrap_policy)}
        return [name for name, module in model.named_modules() if id(module) in chosen]

    def on_after_setup_optimizers(self, trainer: object) -> None:
        """Point ``trainer.optimizer`` (when it has one) at the sharded parameters, in place: the same optimizer
        object, class, hyperparameters and parameter groups, each parameter replaced by its shard (Accelerate
        does the same for FSDP2). An optimizer built after :meth:`configure_ddp` is left as it is.

        Raises:
            ValueError: the optimizer already has state (it stepped, or loaded a ``state_dict``: resume through
                the loop's ``checkpoint_dir`` instead), holds a parameter that is not the model's, or is a
                ``ZeroRedundancyOptimizer`` (FSDP shards the optimizer state already).
        """
        optimizer = getattr(trainer, "optimizer", None)
        if isinstance(optimizer, Optimizer):
            self.shard_optimizer(optimizer)

    def shard_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """``optimizer`` with each unsharded parameter of the model :meth:`configure_ddp` sharded replaced by its
        shard, in place (see :meth:`on_after_setup_optimizers`, which calls it); returns it.

        Raises:
            ValueError: as :meth:`on_after_setup_optimizers`.
        """
        if type(optimizer).__name__ == "ZeroRedundancyOptimizer":
            raise ValueError(
                "FSDPPlugin shards the optimizer state with the parameters: use the optimizer itself (e.g. "
                "torch.optim.AdamW), not a ZeroRedundancyOptimizer around it"
            )
        if self._sharded is None or not self._unsharded:
            return optimizer
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) in self._unsharded]
        if stale and optimizer.state:
            raise ValueError(
                f"FSDPPlugin: the optimizer already holds state for {len(optimizer.state)} parameter(s) (it stepped or "
                "loaded a state_dict) of the unsharded model; give the TrainLoop an optimizer that has not stepped, "
                "and resume a run through its checkpoint_dir"
            )
        for group in optimizer.param_groups:
            replaced = []
            for parameter in group["params"]:
                if id(parameter) in self._unsharded:
                    parameter = self._shards[self._unsharded[id(parameter)][1]]
                elif not any(parameter is p for p in self._shards.values()):
                    raise ValueError(
                        f"FSDPPlugin: the optimizer holds a parameter of shape {tuple(parameter.shape)} that is not "
                        "the model's: build the optimizer on model.parameters()"
                    )
                replaced.append(parameter)
            group["params"] = replaced
        self._unsharded = {}  # the unsharded tensors can go
        return optimizer

    @contextmanager
    def block_backward_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip the gradients' reduce-scatter in backward passes inside the block (gradient accumulation):
        ``set_requires_gradient_sync(False)``; the first backward after it reduces the accumulated sum. Does
        nothing for a model that is not sharded."""
        from torch.distributed.fsdp import FSDPModule

        sharded = unwrap_model(model)
        if not isinstance(sharded, FSDPModule):
            yield
            return
        sharded.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            sharded.set_requires_gradient_sync(True)

    def on_before_manual_backward(self, model: nn.Module, output: Any) -> None:
        """Nothing: FSDP's hooks run in any backward pass through the model's units."""

    # --- state -------------------------------------------------------------------------------------

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, each tensor this rank's shard (``DTensor``), as torch's
        ``get_optimizer_state_dict`` gives it; ``optimizer.state_dict()`` before the model is sharded."""
        if self._sharded is None:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self._sharded, optimizer)

    def checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, directory: Path | None, name: str, *, asynchronous: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        """Write the sharded weights and optimizer state as the sharded checkpoint ``directory / name`` (each rank
        its shards, ``torch.distributed.checkpoint``'s format; every rank calls it); ``({}, {}, name)``. With
        ``asynchronous``: copy the shards to the CPU and start the write (``async_save`` on a gloo group of its
        own), which :meth:`take_pending_write` hands over. ``directory`` ``None``: this rank's shards in memory (a
        recovering replica group's same rank takes them; no collective). Unsharded: the state dicts themselves."""
        if not _is_sharded(model):
            return unwrap_model(model).state_dict(), self.optimizer_state(optimizer), None
        if directory is None:
            return (*local_shards(model, self._shards, optimizer), None)
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": weights, "optimizer": optimizer_state}
        if asynchronous:
            if self._checkpoint_group is None:  # every rank: a collective
                import torch.distributed as dist

                self._checkpoint_group = dist.new_group(backend="gloo")
            self._pending_write = start_saving_sharded(state, directory, name, self._checkpoint_group)
        else:
            save_sharded(state, directory, name)
        return {}, {}, name

    def take_pending_write(self) -> Callable[[], object] | None:
        """The write :meth:`checkpoint_state` started with ``asynchronous``, once (``None``: none)."""
        pending, self._pending_write = self._pending_write, None
        return pending

    def load_checkpoint_state(
        self, model: nn.Module, optimizer: Optimizer, weights: dict[str, Any], optimizer_state: dict[str, Any],
        sharded: Path | None,
    ) -> None:  # fmt: skip
        """Load a checkpoint's weights and optimizer state into the (sharded) model and its optimizer: a
        sharded checkpoint of any world size, resharded for this one; or whole ones (a DDP or one-process
        run's), each rank taking its shards (every rank calls it); or the same rank's shards of a replica group
        of the same size (no collective)."""
        if is_local_shards(weights):
            load_local_shards(model, self._shards, optimizer, weights, optimizer_state)
            return
        if sharded is not None or not _is_sharded(model):
            load_whole_or_sharded(model, optimizer, weights, optimizer_state, sharded)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        module = unwrap_model(model)
        set_state_dict(
            module, optimizer, model_state_dict=weights, optim_state_dict=_named(optimizer_state, optimizer, module),
            options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole weights on the CPU (torch's ``get_model_state_dict`` with ``full_state_dict=True,
        cpu_offload=True``): every rank must call it; rank 0 gets them, the others ``{}``. Unsharded: every
        rank's own ``state_dict()`` on the CPU."""
        if not _is_sharded(model):
            return whole_state_dict(model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights: dict[str, torch.Tensor] = get_model_state_dict(unwrap_model(model), options=options)  # type: ignore[assignment]
        return weights

    def memory(self, model: nn.Module, optimizer: Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds of the model's ``parameters``, ``gradients`` and ``optimizer`` state (its shards;
        the whole tensors unsharded), and their ``total``. With ``W`` ranks about ``1/W`` of what DDP holds;
        a unit's full weights, gathered while it computes, come on top."""
        held = {"parameters": 0, "gradients": 0, "optimizer": 0}
        for parameter in unwrap_model(model).parameters():
            held["parameters"] += _local_bytes(parameter)
            if parameter.grad is not None:
                held["gradients"] += _local_bytes(parameter.grad)
        if optimizer is not None:
            for state in optimizer.state.values():
                held["optimizer"] += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
        return {**held, "total": sum(held.values())}


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(unwrap_model(model), FSDPModule)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def _broadcast_from_rank_zero(model: nn.Module) -> None:
    """Every rank's parameters and buffers made rank 0's (DDP's constructor does the same), so that ranks that
    built their models with different random numbers train one model."""
    import torch.distributed as dist

    if not is_distributed() or get_world_size() == 1:
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)


def _named(state: dict[str, Any], optimizer: Optimizer, model: nn.Module) -> dict[str, Any]:
    """An ``optimizer.state_dict()`` (parameters numbered in the order of its groups) of the unsharded model,
    keyed by parameter name as torch's ``set_optimizer_state_dict`` takes it (the groups hold the same
    parameters, each now a shard: :meth:`FSDPPlugin.shard_optimizer`)."""
    names = {id(p): name for name, p in model.named_parameters()}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if not state or not state.get("param_groups"):
        return state
    numbered = [number for group in state["param_groups"] for number in group["params"]]
    if len(numbered) != len(ordered):
        raise ValueError(
            f"the checkpoint's optimizer state has {len(numbered)} parameters and this optimizer {len(ordered)}: "
            "resume with the optimizer (and parameter groups) that wrote it"
        )
    name_of = dict(zip(numbered, ordered, strict=True))
    return {
        "state": {name_of[number]: value for number, value in state.get("state", {}).items()},
        "param_groups": [{**group, "params": [name_of[n] for n in group["params"]]} for group in state["param_groups"]],
    }
