"""An adapted model built at the few layers depth extrapolation replays, standing for its full depth.

Depth extrapolation (:mod:`.layers`) replays 2 and 3 decoder layers (3 and 4 under checkpointing) of a
homogeneous stack and extends the line to the configured depth; the other layers are cut off around each
replay (:func:`~.layers.truncated`). Building them costs more than replaying: on the Llama-3.1-70B-shaped
LoRA of ``benchmarks/planning_cost.py`` (80 layers, 560 adapted Linear layers), PEFT's ``get_peft_model``
took 0.56 s of CPU and swapping the fakes in 0.26 s, against 0.02 s for the meta-device base, to adapt and
fake 76 layers no replay runs. :func:`short_fake_model` builds the meta base at full depth (its stack
checked homogeneous there, as :func:`~.layers.homogeneous_layers` checks the model it replays), cuts the
stack to :data:`BUILT_LAYERS` — the model :func:`~.layers.truncated` leaves, its config's depth included —
and only then applies the adapter and swaps in the fakes: the path of :func:`~.fake_model.fake_model`
(meta base, ``get_peft_model``, ``fake_in_place``) on fewer layers.

Only where every layer gets the same adapter: a ``peft.LoraConfig`` whose targets are plain module names
(or ``"all-linear"``, or PEFT's default for the architecture) and which names no layer index, pattern or
per-module rank (:func:`index_free`). A quantized base (QLoRA) is quantized and adapted after the cut, then
copied as :func:`~.fake_model.fake_model` copies it (``fake_copy``), the stack found again in the copy. The
estimate uses it only for one process without an engine (:func:`usable`: the engines' rules read the
model's parameters); the parameter counts are the short model's plus one layer's per layer cut
(:meth:`ShortModel.counts`), and where the whole depth must be replayed (the line is not exact, an
extrapolation switched off, the eval loop) :meth:`ShortModel.full` builds the model as before, once.
``tests/test_short_model.py`` checks the estimates byte for byte against the full build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .fake_model import adapted_meta, build_fake_model, config_and_task, count_params, fake_built, fake_model
from .layers import CHECKPOINTED_DEPTHS, SHORT_DEPTHS, homogeneous_layers
from .memo import shortcuts_on
from .peft import LoraSpec
from .quantized import QuantSpec

# The most layers a short replay keeps (3 and 4 under checkpointing, 2 and 3 without).
BUILT_LAYERS = max(*SHORT_DEPTHS, *CHECKPOINTED_DEPTHS)

# ``peft.LoraConfig`` fields that adapt layers differently by index or by pattern: any of them set, the
# whole depth is built (peft/tuners/lora/config.py).
_PER_LAYER_FIELDS = ("layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern", "exclude_modules",
                     "layer_replication", "target_parameters")


@dataclass
class ShortModel:
    """``model`` holds ``len(stack)`` of the ``depth`` identical layers it stands for."""

    model: torch.nn.Module
    stack: torch.nn.ModuleList
    depth: int
    build_full: Callable[[], torch.nn.Module]
    built_full: torch.nn.Module | None = field(default=None, repr=False)

    def full(self) -> torch.nn.Module:
        """The model at its full depth (built on first use, then kept)."""
        if self.built_full is None:
            self.built_full = self.build_full()
        return self.built_full

    def counts(self) -> tuple[int, int]:
        """(all, trainable) parameters of the full-depth model: the short one's, one layer's per layer cut."""
        total, trainable = count_params(self.model)
        layer_total, layer_trainable = count_params(self.stack[0])
        cut = self.depth - len(self.stack)
        return total + cut * layer_total, trainable + cut * layer_trainable


def index_free(peft_config: Any) -> bool:
    """Whether ``peft_config`` adapts every layer of a homogeneous stack alike: a ``LoraConfig`` whose
    targets are module names (no dotted path, no regular expression), ``"all-linear"`` or PEFT's default,
    with no per-layer field set (:data:`_PER_LAYER_FIELDS`)."""
    from peft import LoraConfig

    if type(peft_config) is not LoraConfig or any(getattr(peft_config, name, None) for name in _PER_LAYER_FIELDS):
        return False
    targets = peft_config.target_modules
    if isinstance(targets, str):  # matched as a regular expression over the full module name
        targets = [] if targets == "all-linear" else [None]
    names = [*(targets or []), *(peft_config.modules_to_save or [])]
    return all(isinstance(name, str) and name.isidentifier() for name in names)


def short_fake_model(config: Any, task: str, fake_mode: Any, peft_config: Any,
                     build_full: Callable[[], torch.nn.Module], quantization: QuantSpec | None = None
                     ) -> ShortModel | None:
    """The adapted fake model at :data:`BUILT_LAYERS` layers standing for ``config``'s depth; None where the
    whole depth must be built (a stack that is not homogeneous, a config that is not :func:`index_free`)."""
    if not index_free(peft_config):
        return None
    meta = build_fake_model(config, task, contextlib.nullcontext(), "meta")
    stack = homogeneous_layers(meta, meta.config, CHECKPOINTED_DEPTHS)
    if stack is None:
        return None
    depth = meta.config.num_hidden_layers
    del stack[BUILT_LAYERS:]  # what layers.truncated does around a replay, here for the model's lifetime
    meta.config.num_hidden_layers = BUILT_LAYERS
    if getattr(meta.config, "layer_types", None) is not None:
        meta.config.layer_types = list(meta.config.layer_types)[:BUILT_LAYERS]
    adapted = adapted_meta(meta, peft_config, quantization)
    name = next(name for name, module in adapted.named_modules() if module is stack)
    model = fake_built(adapted, quantization, fake_mode)  # a quantized base is copied: the stack is the copy's
    return ShortModel(model=model, stack=model.get_submodule(name), depth=depth, build_full=build_full)


def usable(request: Any, trainer: Any) -> bool:
    """Whether a short model serves ``request``: one process, no engine, no Trainer (whose rules and
    replays read the whole model); else :meth:`ShortModel.full` does."""
    return trainer is None and request.engine is None and request.world_size == 1 and request.shard == "none"


def fake_model_at_depth(model_or_config: Any, task: str | None, fake_mode: Any, lora: LoraSpec | None = None,
                        peft_config: Any = None, quantization: QuantSpec | None = None
                        ) -> tuple[torch.nn.Module, Any, str, ShortModel | None]:
    """:func:`fake_model`'s (model, config, task, None); for an adapter on a base built here from a config, where
    every layer is adapted alike and the planning shortcuts are on (``memo.shortcuts``), the short model
    standing for the whole depth instead (its model, config, task and itself), the full build deferred to
    :meth:`ShortModel.full`."""
    if isinstance(model_or_config, torch.nn.Module) or (peft_config is None and lora is None) or not shortcuts_on():
        return (*fake_model(model_or_config, task, fake_mode, lora, peft_config, quantization), None)
    config, task = config_and_task(model_or_config, task)
    short = short_fake_model(config, task, fake_mode, peft_config or lora.peft_config(task),
                             lambda: fake_model(config, task, fake_mode, lora, peft_config, quantization)[0],
                             quantization)
    if short is None:
        return (*fake_model(config, task, fake_mode, lora, peft_config, quantization), None)
    return short.model, short.model.config, task, short
