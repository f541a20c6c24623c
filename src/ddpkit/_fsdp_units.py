"""Which submodules of a model ``FSDPPlugin`` shards as units of their own, said on one line, and the marks that
tell the hang watchdog which unit a rank is in (private)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ddpkit.batches import iter_tensors
from ddpkit.hangs._state import mark_model_position

__all__ = ["WrapPolicy", "choose_units", "mark_units", "units_source", "units_text"]

#: Which modules are their own unit: module classes, or ``module -> bool`` (Lightning's ``auto_wrap_policy``).
WrapPolicy = set[type[nn.Module]] | tuple[type[nn.Module], ...] | list[type[nn.Module]] | Callable[[nn.Module], bool]


def units_source(model: nn.Module, policy: WrapPolicy | None) -> str:
    """Where the units come from, in words."""
    if policy is not None:
        return "auto_wrap_policy"
    return "the model's _no_split_modules" if _no_split_classes(model) else "the layers of its stacks"


def choose_units(model: nn.Module, policy: WrapPolicy | None) -> list[nn.Module]:
    """The submodules to shard as units of their own, children before their parents: those ``policy`` (module
    classes, or ``module -> bool``) chooses, else the model's ``_no_split_modules``, else its stacks' layers."""
    if policy is None:
        names = _no_split_classes(model)
        chosen = (
            {id(unit) for unit in model.modules() if type(unit).__name__ in names}
            if names
            else {id(unit) for unit in _stack_layers(model)}
        )
        wanted: Callable[[nn.Module], bool] = lambda module: id(module) in chosen  # noqa: E731
    elif callable(policy) and not isinstance(policy, type):
        wanted = policy
    else:
        classes = tuple(policy)  # type: ignore[arg-type]
        wanted = lambda module: isinstance(module, classes)  # noqa: E731
    return [module for module in reversed(list(model.modules())) if module is not model and wanted(module)]


def _no_split_classes(model: nn.Module) -> set[str]:
    """The class names in the ``_no_split_modules`` of the outermost module that has one (transformers' blocks
    that must stay whole: the model's, or the model's inside a user's wrapper) of which the model has at least one;
    empty when none."""
    hints = (getattr(module, "_no_split_modules", None) for module in model.modules())
    hint: Any = next((found for found in hints if found is not None), ())
    present = {type(module).__name__ for module in model.modules() if module is not model}
    return {name for name in hint if isinstance(name, str)} & present


def units_text(model: nn.Module, units: list[nn.Module], source: str) -> str:
    """``3 units (GPT2Block: transformer.h.0 ... transformer.h.2; from the model's _no_split_modules) and the
    whole model for the rest``: what ``configure_ddp`` shards, on one line."""
    names = {id(module): name for name, module in model.named_modules()}
    by_class: dict[str, list[str]] = {}
    for unit in reversed(units):  # the model's order
        by_class.setdefault(type(unit).__name__, []).append(names[id(unit)])
    kinds = "; ".join(
        f"{cls}: {', '.join(found) if len(found) <= 3 else f'{found[0]} ... {found[-1]}'}"
        for cls, found in by_class.items()
    )
    return (
        f"{len(units)} unit{'s' if len(units) != 1 else ''} of their own ({kinds or 'none'}; from {source}), and the "
        "whole model for the parameters they leave"
    )


def _stack_layers(module: nn.Module) -> Iterator[nn.Module]:
    """The children with parameters of the outermost ``nn.Sequential`` / ``nn.ModuleList`` on each path down
    from ``module`` (the default units)."""
    for child in module.children():
        if isinstance(module, nn.Sequential | nn.ModuleList):
            if any(True for _ in child.parameters()):
                yield child
        else:
            yield from _stack_layers(child)


def mark_units(model: nn.Module) -> None:
    """Hooks that tell the hang watchdog which unit's forward or backward this rank is in (its all-gather, or
    its gradients' reduce-scatter): a hang report names the unit a rank did not reach. Each runs before FSDP's
    own hook of the same kind, which is where a rank waits."""
    from torch.distributed.fsdp import FSDPModule

    for name, unit in model.named_modules():
        if isinstance(unit, FSDPModule) and isinstance(unit, nn.Module):
            label = f"FSDP unit {name!r}" if name else "the sharded model's root"
            unit.register_forward_pre_hook(functools.partial(_entered, f"{label} (forward)"), prepend=True)
            unit.register_forward_hook(functools.partial(_backward_enters, f"{label} (backward)"), prepend=True)


def _entered(label: str, module: nn.Module, args: Any) -> None:
    mark_model_position(label)


def _backward_enters(label: str, module: nn.Module, args: Any, output: Any) -> None:
    """Mark ``label`` when the gradient reaches ``output`` (the unit's backward begins)."""
    if torch.is_grad_enabled():
        for tensor in iter_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(functools.partial(_gradient_arrived, label))  # type: ignore[no-untyped-call]


def _gradient_arrived(label: str, gradient: torch.Tensor) -> None:
    mark_model_position(label)
