"""transformers' generation internals the estimator's generate replay relies on, with their probes.
Verified on transformers 4.57.6 and 5.23.0.

=================================================  ======================================  ================================
private thing (``guards``)                         what relies on it                       without it (``off``)
=================================================  ======================================  ================================
``GenerationMixin._has_unfinished_sequences(       the decoding loop replayed to           estimating generation-based
this_peer_finished, synced_gpus, device)``,        ``max_length`` on fake tokens            prediction: one
the guard of ``_sample``/``_beam_search``          (``estimation/generation.py``)          ``MemWatchConfigError`` line
``GenerationConfig._get_default_generation_``      the default of a generation field the   read from a fresh
``params()`` (5.x; 4.x: a fresh                    config leaves unset (``max_length``:     ``GenerationConfig()``
``GenerationConfig()`` holds the defaults)         20)
=================================================  ======================================  ================================

Example:
    >>> default_generation_param("max_length")
    20
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.errors import MemWatchConfigError
from .probes import Probe, holds
from .trainer_methods import takes


def _guards_the_loop() -> bool:
    from transformers.generation.utils import GenerationMixin

    return (takes("_has_unfinished_sequences", "this_peer_finished", "synced_gpus", "device",
                  owner="GenerationMixin")()
            and "_has_unfinished_sequences" in GenerationMixin._sample.__code__.co_names)


LOOP_GUARD = Probe("transformers", "GenerationMixin._has_unfinished_sequences(this_peer_finished, synced_gpus, device)",
                   "estimating generation-based prediction (predict_with_generate)", _guards_the_loop)


def replace_loop_guard(model: Any, guard: Callable[[bool, bool, Any], bool]) -> None:
    """Make ``model.generate``'s decoding loop ask ``guard`` whether to go on (on this instance only;
    :func:`restore_loop_guard` undoes it); one :class:`MemWatchConfigError` line when this
    transformers does not guard its loop so (warned, ``meta.degraded``)."""
    if not holds(LOOP_GUARD):
        raise MemWatchConfigError(f"{LOOP_GUARD.entry()} (docs/compat.md)")
    model._has_unfinished_sequences = guard


def restore_loop_guard(model: Any) -> None:
    del model._has_unfinished_sequences


def default_generation_param(name: str) -> Any:
    """transformers' default for generation field ``name`` (the defaults ``Seq2SeqTrainer.prediction_step``
    and ``generate`` apply): 5.x's ``_get_default_generation_params()``, a fresh config's value on 4.x."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    if callable(defaults):
        return defaults().get(name)
    return getattr(GenerationConfig(), name, None)  # transformers 4.x: the class's defaults
