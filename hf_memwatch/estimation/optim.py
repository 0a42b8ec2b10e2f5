"""The optimizer the Trainer would build, built over a fake model.

``Trainer.get_optimizer_cls_and_kwargs`` picks the class and kwargs from ``TrainingArguments``
(so ``adamw_torch`` is ``torch.optim.AdamW`` with the Trainer's betas/eps, ``adamw_bnb_8bit`` is
bitsandbytes' ``AdamW`` with ``optim_bits=8``), and the parameters are grouped as
``Trainer.create_optimizer`` groups them (weight decay / no weight decay, trainable only).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..compat.accelerate import accelerate_state_kept
from ..core.errors import MemWatchConfigError

# Defined in core (one list each); named here for the estimator's callers.
from ..core.optimizers import BNB_OPTIMS as BNB_OPTIMS
from ..core.optimizers import SUPPORTED_OPTIMS as SUPPORTED_OPTIMS


@functools.lru_cache(maxsize=32)
def _training_arguments(optim: str) -> Any:
    """``TrainingArguments`` carrying only what decides the optimizer (cached: building them is slow)."""
    from transformers import TrainingArguments

    with warnings.catch_warnings(), tempfile.TemporaryDirectory() as tmp, _accelerate_state_kept():
        warnings.simplefilter("ignore")
        try:
            return TrainingArguments(output_dir=tmp, optim=optim, use_cpu=True, report_to=[])
        except ValueError as exc:
            raise MemWatchConfigError(f"optim {optim!r}: {str(exc).splitlines()[0]}") from None


@contextlib.contextmanager
def _accelerate_state_kept() -> Iterator[None]:
    """Keep accelerate's process-wide state and environment as they were (:mod:`hf_memwatch.compat.accelerate`)."""
    with accelerate_state_kept():
        yield


# The Trainer's choice for torch's own optimizers at ``TrainingArguments``' defaults (no
# ``optim_args``), known without importing ``transformers.trainer`` or ``training_args``: both import
# peft -> bitsandbytes -> ``torch._inductor`` (~2.5 s of CPU) for a request that needs ``torch.optim``
# alone. tests/test_optim.py checks every entry against ``Trainer.get_optimizer_cls_and_kwargs``.
_DEFAULT_LR = 5e-05
_ADAM_DEFAULTS = {"lr": _DEFAULT_LR, "betas": (0.9, 0.999), "eps": 1e-08}
TORCH_NATIVE: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw_torch": ("AdamW", _ADAM_DEFAULTS),
    "adamw_torch_fused": ("AdamW", {**_ADAM_DEFAULTS, "fused": True}),
    "sgd": ("SGD", {"lr": _DEFAULT_LR}),
    "adagrad": ("Adagrad", {"lr": _DEFAULT_LR}),
    "rmsprop": ("RMSprop", {"lr": _DEFAULT_LR}),
}
# The same for bitsandbytes' AdamW variants (the auto mode's 8-bit remedy, :mod:`hf_memwatch.planning.
# catalogue`): the class of ``bitsandbytes.optim`` and the Trainer's kwargs, without the ~0.6 s of CPU of
# ``transformers.trainer`` (bitsandbytes itself is imported: its optimizer is replayed). Used while
# :data:`~hf_memwatch.estimation.memo.SHORTCUTS` is on; tests/test_optim.py checks every entry.
BNB_NATIVE: dict[str, tuple[str, dict[str, Any]]] = {
    "adamw_bnb_8bit": ("AdamW", {**_ADAM_DEFAULTS, "optim_bits": 8, "is_paged": False}),
    "adamw_8bit": ("AdamW", {**_ADAM_DEFAULTS, "optim_bits": 8, "is_paged": False}),
    "paged_adamw_8bit": ("AdamW", {**_ADAM_DEFAULTS, "optim_bits": 8, "is_paged": True}),
    "paged_adamw_32bit": ("AdamW", {**_ADAM_DEFAULTS, "optim_bits": 32, "is_paged": True}),
}
# ``Trainer.get_decay_parameter_names``: no decay for LayerNorm weights and these names.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def optimizer_class_and_kwargs(optim: str, model: torch.nn.Module | None = None) -> tuple[type, dict[str, Any]]:
    """The optimizer class and kwargs the Trainer would use for ``optim``."""
    if optim in TORCH_NATIVE:
        name, kwargs = TORCH_NATIVE[optim]
        return getattr(torch.optim, name), dict(kwargs)
    if _tabled(optim):
        import bitsandbytes.optim

        name, kwargs = BNB_NATIVE[optim]
        return getattr(bitsandbytes.optim, name), dict(kwargs)
    from transformers import Trainer

    args = _training_arguments(optim)
    try:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    except (ImportError, ValueError) as exc:
        raise MemWatchConfigError(f"optim {optim!r} is not available here: {str(exc).splitlines()[0]}") from None
    return cls, dict(kwargs)


def param_groups(model: torch.nn.Module, weight_decay: float = 0.0) -> list[dict[str, Any]]:
    """Trainable parameters grouped as ``Trainer.create_optimizer`` does (decay, then no decay)."""
    from transformers.trainer_pt_utils import get_parameter_names

    decay = set(get_parameter_names(model, [torch.nn.LayerNorm], _NO_DECAY_PATTERNS))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def _tabled(optim: str) -> bool:
    """``optim`` is in :data:`BNB_NATIVE` and the planning shortcuts are on."""
    from .memo import shortcuts_on

    return optim in BNB_NATIVE and shortcuts_on()


def build_optimizer(model: torch.nn.Module, optim: str, target: str = "cpu") -> Any:
    """Instantiate the Trainer's optimizer over ``model``'s (fake) parameters.

    Built outside any fake mode: bitsandbytes fills its quantization maps with ``tolist()``. For a
    CUDA target simulated on CPU tensors, torch optimizers get the implementation torch's
    ``_default_to_fused_or_foreach`` picks for CUDA tensors: ``foreach`` (``fused`` stays fused).
    """
    cls, kwargs = optimizer_class_and_kwargs(optim, model)
    if target == "cuda" and cls.__module__.startswith("torch.optim") and not kwargs.get("fused"):
        if "foreach" in inspect.signature(cls.__init__).parameters and kwargs.get("foreach") is None:
            kwargs["foreach"] = True
    weight_decay = 0.0 if optim in TORCH_NATIVE or _tabled(optim) else _training_arguments(optim).weight_decay
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = cls(param_groups(model, weight_decay), **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        _embeddings_in_32bit(optimizer, model)
    return optimizer


def _embeddings_in_32bit(optimizer: Any, model: torch.nn.Module) -> None:
    """What ``Trainer.create_optimizer`` does for 8-bit bitsandbytes: embeddings keep 32-bit states.

    The Trainer registers the override in bitsandbytes' process-wide manager; a private manager
    gives the fake optimizer the same overrides without touching the global one.
    """
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.__new__(GlobalOptimManager)
    manager.initialize()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer.mng = manager
