"""DeepSpeed ZeRO's optimizer attributes that hold a rank's partitions, and their probe. Verified on
DeepSpeed 0.19.8 (``runtime/zero/stage_1_and_2.py``, ``runtime/zero/stage3.py``).

:mod:`hf_memwatch.engines.zero.live` reads these attributes by name (``getattr(zero, name, None)``):
renamed in a release, a partition would silently leave its class (counted as ``other``). The probe
checks, once per optimizer class, that the class's module still assigns the attributes that hold the
bulk of a rank's bytes (the flat 16-bit weights, the fp32 master partitions, the gradient partition);
failed, one WARNING and ``meta.degraded`` say the classes of ZeRO's partitions are off.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from .probes import Probe, holds

# The attributes of each ZeRO optimizer class that hold the bulk of a rank's bytes.
ZERO_BULK: dict[str, tuple[str, ...]] = {
    "DeepSpeedZeroOptimizer": ("bit16_groups_flat", "single_partition_of_fp32_groups", "averaged_gradients"),
    "DeepSpeedZeroOptimizer_Stage3": ("fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                                      "averaged_gradients"),
}


def _assigns(cls: type, names: tuple[str, ...]) -> bool:
    """Whether the module defining ``cls`` assigns ``self.<name>`` for every name."""
    source = inspect.getsource(sys.modules[cls.__module__])
    return all(f"self.{name} =" in source or f"self.{name}:" in source for name in names)


@functools.cache
def _probe(cls: type) -> Probe | None:
    base = next((c for c in cls.__mro__ if c.__name__ in ZERO_BULK and c.__module__.startswith("deepspeed.")), None)
    if base is None:
        return None
    names = ZERO_BULK[base.__name__]
    return Probe("deepspeed", f"{base.__name__}.{', '.join(names)}",
                 "ZeRO's partitions in their memory classes (counted as other)",
                 functools.partial(_assigns, base, names))


def zero_partitions_named(zero: Any) -> bool:
    """Whether ``zero`` (a DeepSpeed ZeRO optimizer) keeps its partitions under the verified names
    (probed once per class); True for a class this module does not know (nothing to check)."""
    probe = _probe(type(zero))
    return probe is None or holds(probe)
