"""The optimizer names (``TrainingArguments.optim``) hf-memwatch knows: the one definition of each list.

- :data:`ADAMW_NAMES`: AdamW with full-precision states, which 8-bit AdamW replaces without
  changing the algorithm (the planning catalogue's rule);
- :data:`EIGHT_BIT_NAMES`: bitsandbytes' 8-bit AdamW (two 1-byte moments per element);
- :data:`BNB_OPTIMS`: every bitsandbytes optimizer (8-bit and paged 32-bit);
- :data:`SUPPORTED_OPTIMS`: the optimizers the estimator replays.

Example:
    >>> sorted(EIGHT_BIT_NAMES) == sorted(n for n in BNB_OPTIMS if n.endswith("8bit"))
    True
"""

from __future__ import annotations

ADAMW_NAMES = frozenset({"adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused", "adamw_torch_xla"})
EIGHT_BIT_NAMES = frozenset({"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"})
BNB_OPTIMS = EIGHT_BIT_NAMES | {"paged_adamw_32bit"}
SUPPORTED_OPTIMS: tuple[str, ...] = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "sgd",
    "adafactor",
    "adagrad",
    "rmsprop",
)
