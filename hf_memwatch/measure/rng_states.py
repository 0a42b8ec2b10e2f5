"""The CPU RNG state activation checkpointing saves per checkpointed call, counted where it is allocated.

``torch.utils.checkpoint`` (reentrant and not, ``preserve_rng_state=True``, the default) saves
``torch.get_rng_state()`` at each checkpointed forward — a 5,056-byte CPU tensor (the Mersenne-Twister
state) held until that call's recomputation in the backward. It is made by a C++ function, not an
operator, so no dispatch mode sees it: MemWatch's live step peaks and the estimator's replay missed
5,056 B per checkpointed layer, the same bytes in both (the seeded sweep, ``benchmarks/sweep.py``: a
3-layer GPTBigCode with reentrant checkpointing, 1 x 16 tokens, accumulation 2: -15,172 B estimated and
-15,168 B live against the profiler's 2,679,072 B peak, -0.57%; every checkpointed draw under by
5,056 x its layers).

:func:`count_rng_states` wraps ``torch.get_rng_state`` while a tracker is entered (:func:`uncount_rng_states`
puts it back when the last one is left): the state it returns is
registered with every :class:`~hf_memwatch.measure.tracker.StorageTracker` on the calling thread's
dispatch-mode stack that counts CPU memory (a CUDA run's live tracker counts its device only; an
estimate for a CUDA target has ``gpu`` set: the state is host memory there). The tracker then drops it
when the checkpoint frees it, as any storage.

Example:
    >>> import torch
    >>> from hf_memwatch.measure.tracker import StorageTracker
    >>> tracker = StorageTracker("cpu")
    >>> with tracker:
    ...     state = torch.get_rng_state()
    >>> tracker.allocated == state.untyped_storage().nbytes()
    True
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch

from ..compat.torch_internals import current_dispatch_modes

_lock = threading.Lock()
_active = 0  # trackers entered: the wrapper is installed while one is
_original: Any = None


def count_rng_states() -> None:
    """A tracker is entered: ``torch.get_rng_state`` wrapped (by the first), its result registered with the
    active CPU trackers. Pair with :func:`uncount_rng_states`."""
    global _active, _original
    with _lock:
        _active += 1
        if _active > 1:
            return
        _original = original = torch.get_rng_state

        @functools.wraps(original)
        def get_rng_state() -> Any:
            state = original()
            for mode in current_dispatch_modes():  # a CPU StorageTracker (measure/tracker.py) counts it
                if getattr(mode, "counts_rng_states", False) and getattr(mode, "gpu", None) is None:
                    mode.register([state])
            return state

        get_rng_state._hf_memwatch_counted = True  # type: ignore[attr-defined]
        torch.get_rng_state = get_rng_state


def uncount_rng_states() -> None:
    """A tracker is left: the last one puts torch's own ``get_rng_state`` back (unless another library
    wrapped it since, whose wrapper stays: it calls ours, which then only passes the state through)."""
    global _active
    with _lock:
        _active = max(0, _active - 1)
        if _active == 0 and getattr(torch.get_rng_state, "_hf_memwatch_counted", False):
            torch.get_rng_state = _original
