"""The closed sets of names an estimate takes (task, precision, shard, device, bitsandbytes options).

Kept free of torch and transformers: the ``hf-memwatch`` command checks its arguments against them
before it imports anything heavy (a bad flag answers in ~0.2 s, not after seconds of imports).
:mod:`hf_memwatch.estimation.request` and :mod:`hf_memwatch.estimation.quantized` read them from here.
"""

from __future__ import annotations

import os

from ..engines.engine import SHARDS  # noqa: F401 - what a rank holds: the engines' names
from .errors import MemWatchConfigError

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")
QUANT_TYPES = ("nf4", "fp4")  # bnb_4bit_quant_type
COMPUTE_DTYPE_NAMES = ("fp32", "bf16", "fp16")  # bnb_4bit_compute_dtype


def check_path(given: str | None) -> None:
    """A model or adapter path that names a local file or folder (absolute or with a folder part, or a
    ``.json``) and does not exist: the line :mod:`hf_memwatch.estimation.fake_model` would say after
    the imports, said before them (a hub id, ``name``, is left to the loader)."""
    if given and not os.path.exists(given) and (os.sep in given or given.endswith(".json")):
        raise MemWatchConfigError(f"{given}: no such file or directory")
