"""PEFT adapters on the estimator's fake model: a LoRA spec or a saved adapter folder.

The adapter is applied with PEFT's own ``get_peft_model`` to a *meta-device* copy of the base
(PEFT moves each new adapter layer to its base layer's device, which a fake parameter refuses),
and the result becomes the usual fake model through ``fake_copy`` — the path a built ``PeftModel``
takes — or, for a base built here from a config, its tensors swapped for fakes in place
(``fake_in_place``: the same twins, no module copied). The adapter layers, the frozen base, ``modules_to_save`` and PEFT's forward wrappers are
exactly what a real run builds; nothing is allocated.

Usage:
    >>> estimate(config, micro_batch_size=8, seq_len=512, lora=LoraSpec(r=16, targets="all-linear"))  # doctest: +SKIP
    >>> estimate(None, adapter="./my-adapter", micro_batch_size=8, seq_len=512)                    # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import MemWatchConfigError
from ..core.extras import require

ADAPTER_CONFIG = "adapter_config.json"
PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "seq-cls": "SEQ_CLS", "seq2seq": "SEQ_2_SEQ_LM"}


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter as ``peft.LoraConfig`` takes it.

    ``targets``: module names (``("q_proj", "v_proj")``), ``"all-linear"``, or None for PEFT's
    default for the architecture. ``alpha`` None = PEFT's default (8). ``alpha`` and ``dropout``
    do not change memory much but are passed on: a dropout > 0 keeps a mask per adapted input.
    """

    r: int = 8
    alpha: float | None = None
    targets: tuple[str, ...] | str | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require("peft", "a LoRA adapter (--lora-r, LoraSpec)")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r <= 0:
            raise MemWatchConfigError(f"lora r must be a positive integer; got {self.r!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise MemWatchConfigError(f"lora dropout must be in [0, 1); got {self.dropout!r}")

    @classmethod
    def from_targets_text(cls, r: int, alpha: float | None, targets: str | None, dropout: float) -> LoraSpec:
        """From the CLI's comma-separated ``--lora-targets`` (``all-linear`` kept as is)."""
        parsed: tuple[str, ...] | str | None = None
        if targets:
            parsed = targets if targets == "all-linear" else tuple(t.strip() for t in targets.split(",") if t.strip())
        return cls(r=r, alpha=alpha, targets=parsed, dropout=dropout)

    def peft_config(self, task: str) -> Any:
        """The ``peft.LoraConfig`` for ``task``."""
        from peft import LoraConfig

        kwargs: dict[str, Any] = dict(r=self.r, lora_dropout=float(self.dropout),
                                      task_type=PEFT_TASK_TYPES.get(task))
        if self.alpha is not None:
            kwargs["lora_alpha"] = self.alpha
        if self.targets is not None:
            kwargs["target_modules"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        return LoraConfig(**kwargs)


def is_adapter_dir(path: Any) -> bool:
    """A folder PEFT's ``save_pretrained`` wrote: ``adapter_config.json`` and no model ``config.json``."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    path = os.fspath(path)
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
            and not os.path.isfile(os.path.join(path, "config.json")))


def load_adapter(path: str | os.PathLike) -> tuple[Any, str | None]:
    """(``PeftConfig`` of the saved adapter, its ``base_model_name_or_path``); one-line errors.

    ``save_pretrained`` writes ``inference_mode: true``; the estimate is of training the adapter
    further, so it is loaded trainable.
    """
    require("peft", "a saved PEFT adapter (--adapter)")
    from peft import PeftConfig

    path = os.fspath(path)
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise MemWatchConfigError(f"{path}: no {ADAPTER_CONFIG} (not a saved PEFT adapter)")
    try:
        with open(file, encoding="utf-8") as handle:
            base = json.load(handle).get("base_model_name_or_path")
        config = PeftConfig.from_pretrained(path)
        config.inference_mode = False  # trained on, as PeftModel.from_pretrained(..., is_trainable=True)
    except (OSError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise MemWatchConfigError(f"{file}: cannot read the adapter config: {exc}") from None
    return config, base or None


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A structural copy of ``model`` with every parameter and buffer on the meta device (ties kept)."""
    import copy

    from ..measure.attribution import is_quantized_param

    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        if is_quantized_param(tensor):
            # Shared, not copied: a meta tensor would lose its quantization state, and PEFT leaves the
            # frozen base weight alone (the fake copy made next replaces it).
            memo[id(tensor)] = tensor
            continue
        meta = torch.empty_like(tensor.detach(), device="meta")
        if isinstance(tensor, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
        memo[id(tensor)] = meta
    return copy.deepcopy(model, memo)


def apply_peft(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """``peft.get_peft_model(model, peft_config)`` on a meta-device ``model`` (modified in place)."""
    from peft import get_peft_model

    try:
        with torch.device("meta"):
            return get_peft_model(model, peft_config)
    except (ValueError, KeyError) as exc:  # e.g. target modules not found in the model
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MemWatchConfigError(f"cannot apply the adapter to {type(model).__name__}: {first}") from None
