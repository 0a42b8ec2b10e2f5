"""Staying out of ``torch.compile``'s way: where to hook a compiled model, and whether it is compiled.

Dynamo traces a module's forward hooks together with its forward when the module itself is
compiled, so Python-side work in a hook (reading the allocator, writing the timeline) would break
the graph. The Trainer compiles by wrapping (``torch.compile(model)`` → ``OptimizedModule``, which
``trainer.model_wrapped`` holds); hooks on that wrapper run in plain Python around the compiled call.
A module compiled in place (``module.compile()``) runs its ``_call_impl`` under Dynamo, which
skips that frame but would convert each hook called from it into a frame of its own: MemWatch's hooks
are then wrapped in :func:`torch.compiler.disable` (:func:`hooks_for`) and run as plain Python. Where
Dynamo inlines a hook instead (a compiled parent module), the hook returns at once while Dynamo traces
(:func:`torch.compiler.is_compiling`, a constant to Dynamo), adding nothing to the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compat.torch_compile import compiled_in_place as _compiled_in_place
from ..compat.torch_compile import optimized_module_type


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` or one of its submodules runs under ``torch.compile``.

    Example:
        >>> is_compiled_module(torch.nn.Linear(2, 2))
        False
    """
    optimized = optimized_module_type()
    if optimized is None or not isinstance(module, torch.nn.Module):
        return False
    if isinstance(module, optimized):
        return True
    return any(
        isinstance(sub, optimized) or compiled_in_place(sub)
        for sub in module.modules()
    )


def hook_target(model: Any, wrapped: Any) -> Any:
    """The module to put forward hooks on: the compiled wrapper the Trainer calls, else ``model``."""
    optimized = optimized_module_type()
    if optimized is not None and isinstance(wrapped, optimized):
        return wrapped
    return model


def compiled_in_place(module: Any) -> bool:
    """Whether ``module`` itself was compiled in place (``module.compile()``)."""
    return _compiled_in_place(module)


def hooks_for(target: Any, before: Callable[..., Any], after: Callable[..., Any]) -> tuple[Callable, Callable]:
    """The (pre, post) forward hooks to register on ``target``: run outside Dynamo where it is compiled in place."""
    if compiled_in_place(target):
        return torch.compiler.disable(before), torch.compiler.disable(after)
    return before, after


def runs_compiled(trainer: Any, model: Any) -> bool:
    """Whether this training run compiles the model (Trainer's ``torch_compile`` or a user's compile)."""
    if trainer is not None and bool(getattr(getattr(trainer, "args", None), "torch_compile", False)):
        return True
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    return is_compiled_module(wrapped) or is_compiled_module(model)


def tracing() -> bool:
    """True while Dynamo traces the calling code (a constant to Dynamo: the branch costs no graph break)."""
    return torch.compiler.is_compiling()
