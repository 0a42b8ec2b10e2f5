"""The closed sets of names an estimate takes (task, precision, shard, device, bitsandbytes options).

Kept free of torch and transformers: the ``hf-memwatch`` command checks its arguments against them
before it imports anything heavy (a bad flag answers in ~0.2 s, not after seconds of imports).
:mod:`hf_memwatch.estimation.request` and :mod:`hf_memwatch.estimation.quantized` read them from here.
"""

from __future__ import annotations

from ..engines.engine import SHARDS  # noqa: F401 - what a rank holds: the engines' names

TASKS = ("causal-lm", "seq-cls", "masked-lm", "seq2seq")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")
QUANT_TYPES = ("nf4", "fp4")  # bnb_4bit_quant_type
COMPUTE_DTYPE_NAMES = ("fp32", "bf16", "fp16")  # bnb_4bit_compute_dtype
