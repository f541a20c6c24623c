"""The callback protocol: ``Callback``, ``CallbacksHandler``, aitoolbox's ``DistributedSamplerSetEpoch``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.utils.data import DistributedSampler

from ddpkit._compat import override
from ddpkit.samplers import epoch_seed

__all__ = ["Callback", "CallbacksHandler", "DistributedSamplerSetEpoch", "Event", "TrainLoopView"]

Event = Literal["on_train_begin", "on_epoch_begin", "on_batch_end", "on_epoch_end", "on_train_end"]


class TrainLoopView(Protocol):
    """What a callback is given: the train loop (:class:`~ddpkit.TrainLoop` has all of this, and more)."""

    #: The model being trained (not the DDP wrapper).
    model: nn.Module
    #: The epoch in progress (0-based).
    epoch: int
    #: Optimizer steps taken in all.
    global_step: int
    #: Per epoch: ``train_loss``, ``validation_<metric>``, ``items_per_second`` and ``peak_memory_mib``; per
    #: ``evaluate_every`` evaluation: ``eval_step`` and ``eval_<metric>``.
    history: dict[str, list[float]]
    #: This rank's (sum of sample losses, samples) in the last optimizer step (float64, shape ``(2,)``, on the
    #: loss's device: reading it waits for the device).
    step_loss: torch.Tensor
    #: Set it (on every rank) to end training: in ``on_batch_end`` after this optimizer step (its checkpoint
    #: written), in ``on_epoch_end`` after this epoch.
    should_stop: bool
    #: What the last optimizer step measured besides its loss, the same on every rank: ``lr`` (with a
    #: learning-rate scheduler), ``grad_norm`` (before clipping, with gradient clipping); a value the step kept on
    #: the device is read when first asked for.
    step_metrics: Mapping[str, float]


class Callback:
    """Hooks into :class:`~ddpkit.TrainLoop`; override the events you need (each gets the train loop).

    ``on_batch_end`` runs after each optimizer step. Callbacks run on every rank;
    use :func:`~ddpkit.rank_zero_only` for work that one rank should do.
    """

    def on_train_begin(self, train_loop: TrainLoopView) -> None:
        """Before the first epoch (after a checkpoint, if any, was loaded)."""

    def on_epoch_begin(self, train_loop: TrainLoopView) -> None:
        """At the start of each epoch, before the first batch (``train_loop.epoch`` is set)."""

    def on_batch_end(self, train_loop: TrainLoopView) -> None:
        """After each optimizer step (``train_loop.global_step`` counts them)."""

    def on_epoch_end(self, train_loop: TrainLoopView) -> None:
        """After each epoch's training and validation (``train_loop.history`` holds its numbers)."""

    def on_train_end(self, train_loop: TrainLoopView) -> None:
        """After the last epoch."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of this callback; saved in ``TrainLoop``'s checkpoints (plain values only:
        numbers, strings, lists, dicts). Default: nothing."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (before ``on_train_begin`` of a resumed run)."""


class CallbacksHandler:
    """The callbacks of one train loop (aitoolbox's ``callbacks_handler``)."""

    def __init__(self, train_loop: TrainLoopView) -> None:
        self.train_loop = train_loop
        self.callbacks: list[Callback] = []
        self._hooks: dict[str, list[Any]] = {}  # each event's overriding methods, for ``_hooked``
        self._hooked: list[Callback] = []  # the callbacks ``_hooks`` was made for

    def register_callbacks(self, callbacks: Iterable[Callback] | Callback | None) -> None:
        """Add callbacks; they run in the order they were registered.

        Raises:
            TypeError: something that is not a :class:`Callback`.
        """
        if callbacks is None:
            return
        items = [callbacks] if isinstance(callbacks, Callback) else list(callbacks)
        for callback in items:
            if not isinstance(callback, Callback):
                raise TypeError(f"callbacks must be ddpkit.Callback instances, got {type(callback).__name__}")
        self.callbacks.extend(items)

    def execute(self, event: Event) -> None:
        """Run ``event`` on every callback (a callback whose class does not override it is skipped: its method
        does nothing)."""
        if self._hooked != self.callbacks:  # registered or changed since: find the overriding methods again
            self._hooked, self._hooks = list(self.callbacks), {}
        hooks = self._hooks.get(event)
        if hooks is None:
            default = getattr(Callback, event)
            hooks = self._hooks[event] = [
                getattr(callback, event)
                for callback in self.callbacks
                if getattr(type(callback), event) is not default or event in getattr(callback, "__dict__", ())
            ]
        for hook in hooks:
            hook(self.train_loop)

    def state_dicts(self) -> dict[str, dict[str, Any]]:
        """Every callback's :meth:`~Callback.state_dict` that is not empty, keyed by class name and occurrence."""
        return {key: state for key, callback in self._keyed() if (state := callback.state_dict())}

    def load_state_dicts(self, states: dict[str, dict[str, Any]]) -> None:
        """Give each registered callback its state from :meth:`state_dicts` (those not in ``states`` keep theirs)."""
        for key, callback in self._keyed():
            if key in states:
                callback.load_state_dict(states[key])

    def _keyed(self) -> list[tuple[str, Callback]]:
        seen: dict[str, int] = {}
        keyed = []
        for callback in self.callbacks:
            name = type(callback).__name__
            seen[name] = seen.get(name, -1) + 1
            keyed.append((f"{name}-{seen[name]}", callback))
        return keyed


class DistributedSamplerSetEpoch(Callback):
    """Keep the distributed samplers' epochs right: ``set_epoch(train_loop.epoch)`` at each epoch start.

    Name and arguments from aitoolbox (its ``DDPHandler.add_distributed_samplers``
    registers it). ddpkit's samplers advance by themselves too, but an explicit
    epoch also makes a resumed run reproduce the epoch it stopped in.

    Args:
        train_sampler, validation_sampler, test_sampler: the samplers (``None`` to skip).
        generators: the loaders' own generators, reseeded each epoch from
            ``seed`` and the epoch (``epoch_seed``) so that
            starting a loader's iterator never draws from the global RNG and
            depends on the epoch only.
        seed: the base seed for ``generators``.
        streams: loaders over streams (:class:`~ddpkit.StreamDataLoader`) whose epoch to set too.
    """

    def __init__(
        self,
        train_sampler: DistributedSampler[Any] | None,
        validation_sampler: DistributedSampler[Any] | None = None,
        test_sampler: DistributedSampler[Any] | None = None,
        generators: Iterable[torch.Generator] = (),
        seed: int = 0,
        streams: Iterable[Any] = (),
    ) -> None:
        self.samplers: list[Any] = [s for s in (train_sampler, validation_sampler, test_sampler) if s is not None]
        self.samplers += list(streams)
        self.generators = list(generators)
        self.seed = seed

    @override
    def on_epoch_begin(self, train_loop: TrainLoopView) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(train_loop.epoch)
        for generator in self.generators:
            generator.manual_seed(epoch_seed(self.seed, train_loop.epoch))
