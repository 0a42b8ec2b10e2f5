"""Staying out of ``torch.compile``'s way: where to hook a compiled model, and whether it is compiled.

Dynamo traces a module's forward hooks together with its forward when the module itself is
compiled, so Python-side work in a hook (reading the allocator, writing the timeline) would break
the graph. The Trainer compiles by wrapping (``torch.compile(model)`` → ``OptimizedModule``, which
``trainer.model_wrapped`` holds); hooks on that wrapper run in plain Python around the compiled call.
A module compiled in place (``module.compile()``) traces its own hooks: MemWatch's hooks return at
once while Dynamo traces (:func:`torch.compiler.is_compiling`), so they add nothing to the graph.
"""

from __future__ import annotations

from typing import Any

import torch


def _optimized_module_type() -> type | None:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without Dynamo
        return None
    return OptimizedModule


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` or one of its submodules runs under ``torch.compile``.

    Example:
        >>> is_compiled_module(torch.nn.Linear(2, 2))
        False
    """
    optimized = _optimized_module_type()
    if optimized is None or not isinstance(module, torch.nn.Module):
        return False
    if isinstance(module, optimized):
        return True
    return any(
        isinstance(sub, optimized) or getattr(sub, "_compiled_call_impl", None) is not None
        for sub in module.modules()
    )


def hook_target(model: Any, wrapped: Any) -> Any:
    """The module to put forward hooks on: the compiled wrapper the Trainer calls, else ``model``."""
    optimized = _optimized_module_type()
    if optimized is not None and isinstance(wrapped, optimized):
        return wrapped
    return model


def runs_compiled(trainer: Any, model: Any) -> bool:
    """Whether this training run compiles the model (Trainer's ``torch_compile`` or a user's compile)."""
    if trainer is not None and bool(getattr(getattr(trainer, "args", None), "torch_compile", False)):
        return True
    wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
    return is_compiled_module(wrapped) or is_compiled_module(model)


def tracing() -> bool:
    """True while Dynamo traces the calling code (a constant to Dynamo: the branch costs no graph break)."""
    return torch.compiler.is_compiling()
