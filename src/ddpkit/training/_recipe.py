"""What a ``TrainLoop`` does around each step besides the loss: learning-rate schedules, mixed precision,
gradient clipping and ``torch.compile`` (Lightning's ``precision=``, ``gradient_clip_val=``, schedulers and
compile; Accelerate's ``mixed_precision=`` and ``clip_grad_norm_``).

Every part acts where one process would: the loss is scaled (fp16) before
backward, and the gradients are unscaled, measured and clipped at the
optimizer step only, after DDP's all-reduce (with accumulation after the last
micro-batch), so every rank clips the same summed gradient and DDP still equals
one process. A step that fp16's scaler skips (inf or nan in the gradients) is
skipped on every rank: the gradients it checks are the all-reduced ones.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeAlias, get_args

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from ddpkit.batches import iter_tensors

__all__ = ["Interval", "Precision", "Recipe", "SchedulerFactory", "StepOutcome"]

#: Lightning's names: full precision, bfloat16 autocast, float16 autocast with a gradient scaler.
Precision = Literal["32", "bf16-mixed", "16-mixed"]
#: When the scheduler steps: after every optimizer step, or after every epoch.
Interval = Literal["step", "epoch"]
Scheduler: TypeAlias = LRScheduler | ReduceLROnPlateau
#: ``optimizer -> scheduler``: builds the scheduler on the optimizer of the process that trains.
SchedulerFactory: TypeAlias = Callable[[torch.optim.Optimizer], Scheduler]

_NO_CONTEXT = contextlib.nullcontext()  # reusable: it holds nothing
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class StepOutcome:
    """What happened at an optimizer step: whether it was taken, and the gradients' norm before clipping (a 0-d
    tensor on the gradients' device: read only when someone asks)."""

    __slots__ = ("grad_norm", "taken")

    def __init__(self, taken: bool, grad_norm: torch.Tensor | None) -> None:
        self.taken, self.grad_norm = taken, grad_norm


class Recipe:
    """The schedule, precision, clipping and compilation of one ``TrainLoop`` (its arguments, checked at once).

    Raises:
        ValueError: an unknown ``precision`` or ``interval``, a negative or
            non-finite clip, both clips, or ``ReduceLROnPlateau`` stepped per step.
        TypeError: a scheduler that is neither a torch scheduler nor a callable, or a ``compile`` that is
            neither a bool nor a dict of ``torch.compile`` arguments.
    """

    def __init__(
        self, *, lr_scheduler: Scheduler | SchedulerFactory | None, interval: str, monitor: str, precision: str,
        clip_norm: float | None, clip_value: float | None, compile: bool | dict[str, Any],
    ) -> None:  # fmt: skip
        if precision not in get_args(Precision):
            raise ValueError(f"precision={precision!r}: use one of {', '.join(map(repr, get_args(Precision)))}")
        if interval not in get_args(Interval):
            raise ValueError(f"lr_scheduler_interval={interval!r}: use 'step' or 'epoch'")
        for name, clip in (("gradient_clip_norm", clip_norm), ("gradient_clip_val", clip_value)):
            if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or not clip > 0
                                     or not math.isfinite(clip)):  # fmt: skip
                raise ValueError(f"{name}={clip!r} must be a finite number > 0 (or None)")
        if clip_norm is not None and clip_value is not None:
            raise ValueError(
                f"gradient_clip_norm={clip_norm} and gradient_clip_val={clip_value}: pass one (the norm clips the "
                "whole gradient, the value each element)"
            )
        if not (lr_scheduler is None or isinstance(lr_scheduler, LRScheduler | ReduceLROnPlateau)) and not callable(
            lr_scheduler
        ):
            raise TypeError(
                f"lr_scheduler={lr_scheduler!r}: give a torch.optim.lr_scheduler scheduler on the loop's optimizer, "
                "or a callable optimizer -> scheduler"
            )
        if isinstance(lr_scheduler, ReduceLROnPlateau) and interval == "step":
            raise ValueError(
                "ReduceLROnPlateau steps on a validation metric, once per epoch: use lr_scheduler_interval='epoch'"
            )
        if not isinstance(compile, bool | dict):
            raise TypeError(f"compile={compile!r}: give True, False or a dict of torch.compile arguments")
        self.interval, self.monitor, self.precision = interval, monitor, precision
        self.clip_norm, self.clip_value, self.compile_options = clip_norm, clip_value, compile
        self._given = lr_scheduler
        #: The scheduler, once :meth:`bind` built it (or was given it).
        self.scheduler: Scheduler | None = (
            lr_scheduler if isinstance(lr_scheduler, LRScheduler | ReduceLROnPlateau) else None
        )
        #: fp16's gradient scaler, once :meth:`bind` made it.
        self.scaler: torch.amp.GradScaler | None = None
        self._device_type = "cpu"
        self._optimizer_steps = 0  # steps the optimizer took (fp16's scaler skips some): counted by a hook
        self._counting: Any = None  # the hook's handle

    # --- set-up -------------------------------------------------------------------------------------

    def bind(self, optimizer: torch.optim.Optimizer, device: torch.device, sharded: bool = False) -> None:
        """Build the scheduler from a callable (once) and fp16's scaler, for ``optimizer`` on ``device`` (for a
        ``sharded`` model's gradients torch's ``ShardedGradScaler``: whether any shard of any rank holds an inf or
        nan is agreed with one all-reduce, so every rank skips the same steps).

        Raises:
            ValueError: the scheduler is on another optimizer than the loop's.
            TypeError: the callable returned no torch scheduler.
        """
        self._device_type = device.type
        if self.scheduler is None and self._given is not None:
            built = self._given(optimizer)  # type: ignore[operator]
            if not isinstance(built, LRScheduler | ReduceLROnPlateau):
                raise TypeError(f"lr_scheduler({type(optimizer).__name__}) returned {built!r}, not a torch scheduler")
            if isinstance(built, ReduceLROnPlateau) and self.interval == "step":
                raise ValueError(
                    "ReduceLROnPlateau steps on a validation metric, once per epoch: use lr_scheduler_interval='epoch'"
                )
            self.scheduler = built
        if self.scheduler is not None and self.scheduler.optimizer is not optimizer:
            raise ValueError(
                "lr_scheduler is on another optimizer than the TrainLoop's: build it on the optimizer you give the "
                "TrainLoop, or pass a callable optimizer -> scheduler"
            )
        if self.precision == "16-mixed" and self.scaler is None:
            if sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)
        if self.scaler is not None and self._counting is None:
            # Whether the scaler skipped a step, without reading its scale back: it calls the optimizer's step
            # only when it found no inf or nan (its own one read of the device per step).
            self._counting = optimizer.register_step_post_hook(self._count_optimizer_step)

    def _count_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_steps += 1

    def __getstate__(self) -> dict[str, Any]:  # a TrainLoop travels to fit_distributed's workers: bound there again
        return {**self.__dict__, "_counting": None}

    def compiled(self, model: nn.Module) -> nn.Module:
        """``model`` (the DDP-wrapped one) compiled as ``torch.compile(model, **options)``, or itself.

        PyTorch compiles the DDP module (not the model inside it), so that its
        graph breaks at DDP's buckets and the all-reduce still overlaps backward.

        Raises:
            RuntimeError: the backend is not one torch has, or inductor on CPU
                finds no C++ compiler (naming the one it looked for).
        """
        if self.compile_options is False:
            return model
        options = dict(self.compile_options) if isinstance(self.compile_options, dict) else {}
        backend = options.get("backend", "inductor")
        if isinstance(backend, str):
            known = torch.compiler.list_backends(exclude_tags=())
            if backend not in known:
                raise RuntimeError(
                    f"compile: torch.compile has no backend {backend!r}; it has {', '.join(sorted(known))}"
                )
            if backend == "inductor" and self._device_type == "cpu":
                compiler = os.environ.get("CXX") or "g++"
                if shutil.which(compiler) is None:
                    raise RuntimeError(
                        f"compile: inductor needs a C++ compiler on CPU and found no {compiler!r} (CXX names it): "
                        "install one (apt-get install g++), or pass compile={'backend': 'aot_eager'}"
                    )
        return torch.compile(model, **options)  # type: ignore[return-value]

    # --- each step -----------------------------------------------------------------------------------

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The forward's precision: autocast on ``device``'s type for a mixed precision, else nothing."""
        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return _NO_CONTEXT
        return torch.autocast(device_type=device.type, dtype=dtype)

    def backward(self, loss: torch.Tensor, scale: float = 1.0, outputs: list[Any] | None = None) -> None:
        """``(loss * scale).backward()``, scaled by fp16's scaler; with ``outputs`` (a batch that counts nothing: the
        model's outputs in it) the backward of those outputs with zero gradients instead, whatever ``loss`` is:
        every collective of the model's backward runs, and the gradients it adds are exactly zero."""
        gradients: list[torch.Tensor] | None = None
        if outputs is not None:
            tensors = [t for output in outputs for t in iter_tensors(output) if t.requires_grad]
            gradients = [torch.zeros_like(t) for t in tensors]
        else:
            scaled = loss if scale == 1.0 else loss * scale
            tensors = [self.scaler.scale(scaled) if self.scaler is not None else scaled]
        if tensors:
            torch.autograd.backward(tensors, gradients)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, parameters: Iterator[nn.Parameter]) -> StepOutcome:
        """Unscale, measure and clip the (all-reduced) gradients, then step ``optimizer`` unless fp16 found an
        inf or nan in them (then its scale shrinks and the step is skipped, on every rank alike). Nothing is read
        back to the host but fp16's scaler's own check (one read per step); the norm stays on the device."""
        norm: torch.Tensor | None = None
        if self.clip_norm is not None or self.clip_value is not None:
            if self.scaler is not None:
                self.scaler.unscale_(optimizer)
            with_grads = [p for p in parameters if p.grad is not None]
            if self.clip_norm is not None:
                norm = torch.nn.utils.clip_grad_norm_(with_grads, self.clip_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in with_grads])  # type: ignore[misc]
                torch.nn.utils.clip_grad_value_(with_grads, self.clip_value)  # type: ignore[arg-type]
        if self.scaler is None:
            optimizer.step()
            return StepOutcome(True, norm)
        if optimizer.defaults.get("fused"):  # the scaler lets a fused optimizer skip the step on the device
            scale = self.scaler.get_scale()  # so the scale tells (two reads)
            self.scaler.step(optimizer)
            self.scaler.update()
            return StepOutcome(self.scaler.get_scale() >= scale, norm)
        before = self._optimizer_steps
        self.scaler.step(optimizer)
        self.scaler.update()
        return StepOutcome(self._optimizer_steps > before, norm)

    def after_step(self, outcome: StepOutcome) -> None:
        """Step a per-step scheduler after a step that was taken (a skipped one keeps its learning rate)."""
        if self.interval == "step" and self.scheduler is not None and outcome.taken:
            self.scheduler.step()

    def after_epoch(self, history: dict[str, list[float]]) -> None:
        """Step a per-epoch scheduler; ``ReduceLROnPlateau`` with the epoch's :attr:`monitor` from ``history``
        (the whole split's number, the same on every rank).

        Raises:
            KeyError: ``ReduceLROnPlateau`` monitors a name that ``history`` lacks (naming those it has).
        """
        if self.interval != "epoch" or self.scheduler is None:
            return
        if isinstance(self.scheduler, ReduceLROnPlateau):
            values = history.get(self.monitor)
            if not values:
                raise KeyError(
                    f"ReduceLROnPlateau monitors {self.monitor!r} (lr_scheduler_monitor), which the history does not "
                    f"have; it has {sorted(history)} (validation metrics need a validation_loader)"
                )
            self.scheduler.step(values[-1])
        else:
            self.scheduler.step()

    @staticmethod
    def learning_rate(optimizer: torch.optim.Optimizer) -> float:
        """The first parameter group's learning rate (what the next step uses)."""
        return float(optimizer.param_groups[0]["lr"])

    # --- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's and the scaler's states (empty when there are none)."""
        state: dict[str, Any] = {}
        if self.scheduler is not None:
            state["lr_scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a part that is absent, or not used now, is left alone)."""
        if self.scheduler is not None and "lr_scheduler" in state:
            self.scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
