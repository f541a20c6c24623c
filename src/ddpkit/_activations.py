"""Activation checkpointing of chosen submodules (Lightning's ``activation_checkpointing_policy``): each keeps only
its inputs in the forward and computes its activations again in the backward (torch's non-reentrant
``torch.utils.checkpoint``), trading compute for memory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ddpkit._torch_private import private

__all__ = ["ActivationCheckpointingPolicy", "checked_policy", "checkpoint_activations"]

#: Which submodules recompute their activations: module classes, a callable ``module -> bool``, or torch's
#: auto-wrap policy ``(module, recurse, nonwrapped_numel) -> bool`` (what Lightning passes on).
ActivationCheckpointingPolicy = (
    set[type[nn.Module]] | frozenset[type[nn.Module]] | tuple[type[nn.Module], ...] | list[type[nn.Module]]
    | type[nn.Module] | Callable[..., bool]
)  # fmt: skip


def checked_policy(policy: ActivationCheckpointingPolicy | None) -> ActivationCheckpointingPolicy | None:
    """``policy`` once checked (a single class becomes a set of it).

    Raises:
        TypeError: ``policy`` is neither ``nn.Module`` classes nor a callable.
    """
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if callable(policy):
        return policy
    classes = tuple(policy)
    if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(
            f"activation_checkpointing_policy={policy!r}: give nn.Module classes (e.g. {{TransformerBlock}}) or a "
            "callable module -> bool"
        )
    return set(classes)


def checkpoint_activations(model: nn.Module, policy: ActivationCheckpointingPolicy) -> list[str]:
    """Wrap each submodule of ``model`` that ``policy`` chooses (the outermost, not ``model`` itself) in torch's
    non-reentrant ``checkpoint_wrapper``, in place; the names of those wrapped. ``state_dict`` keys stay as they
    were (the wrapper removes its prefix); ``named_parameters`` gains ``_checkpoint_wrapped_module.``.

    Raises:
        ValueError: ``policy`` chose no submodule of ``model`` (the option would silently change nothing).
    """
    wrapper_class = private("checkpoint_wrapper_class")  # torch's own, as torchtitan uses it
    checkpoint_wrapper, no_reentrant = private("checkpoint_wrapper"), private("checkpoint_impl").NO_REENTRANT

    if any(isinstance(module, wrapper_class) for module in model.modules()):  # done already (a second set-up)
        return [n.replace("._checkpoint_wrapped_module", "") for n, m in model.named_modules()
                if isinstance(m, wrapper_class)]  # fmt: skip
    checked = checked_policy(policy)
    assert checked is not None
    options: dict[str, Any]
    if callable(checked) and not isinstance(checked, type) and "recurse" in _parameters(checked):  # torch's
        options = {"auto_wrap_policy": checked}
    elif callable(checked) and not isinstance(checked, type):
        options = {"check_fn": checked}
    else:
        classes = (checked,) if isinstance(checked, type) else tuple(checked)
        options = {"check_fn": lambda module: isinstance(module, classes)}
    wrap = lambda module: checkpoint_wrapper(module, checkpoint_impl=no_reentrant)  # noqa: E731
    private("apply_activation_checkpointing")(model, checkpoint_wrapper_fn=wrap, **options)
    wrapped = [name for name, module in model.named_modules() if isinstance(module, wrapper_class)]
    if not wrapped:
        raise ValueError(
            f"activation_checkpointing_policy={policy!r} chose no submodule of {type(model).__name__}: name the "
            "classes of its blocks (e.g. {TransformerBlock}) or give a callable that returns True for them"
        )
    return [name.replace("._checkpoint_wrapped_module", "") for name in wrapped]


def _parameters(function: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()
