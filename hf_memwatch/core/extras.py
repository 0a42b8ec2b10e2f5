"""The optional dependencies (``pip install hf-memwatch[extra]``): what each turns on, and one line when it is off.

Only torch, transformers, accelerate, rich and packaging are required (setup.cfg ``install_requires``).
Each optional package below belongs to one extra of setup.cfg's ``extras_require``; without it, the
feature it serves is off and says so in one line naming the ``pip install`` that turns it on, and the
documented fallback stands in where there is one:

============  ==========  =============================================  ==========================================
package        extra       turns on                                       without it
============  ==========  =============================================  ==========================================
matplotlib     plot        the picture (``memory.png``)                   the steps table (``memory.html``, no picture)
plotly         page        the interactive page (``memory.html``)         the static page: the picture and the table
peft           peft        LoRA estimates (``--lora-r``, ``--adapter``)    one line, no estimate
bitsandbytes   bnb         quantized bases, 8-bit optimizers              one line; not planned as a remedy
deepspeed      deepspeed   DeepSpeed ZeRO runs                            (the Trainer's own requirement)
trl            trl         TRL trainers                                   (the trainer's own requirement)
============  ==========  =============================================  ==========================================

Example:
    >>> off_line("matplotlib")
    "the picture (memory.png) is off: matplotlib is not installed (pip install 'hf-memwatch[plot]')"
"""

from __future__ import annotations

import importlib.util

from .errors import MemWatchConfigError

#: package -> (the setup.cfg extra that installs it, what it turns on)
EXTRAS: dict[str, tuple[str, str]] = {
    "matplotlib": ("plot", "the picture (memory.png)"),
    "plotly": ("page", "the interactive page (memory.html)"),
    "peft": ("peft", "LoRA estimates (--lora-r, --adapter)"),
    "bitsandbytes": ("bnb", "quantized bases and 8-bit optimizers"),
    "deepspeed": ("deepspeed", "DeepSpeed ZeRO"),
    "trl": ("trl", "TRL trainers"),
}


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (its spec is found; nothing is imported).

    A package blocked on ``sys.meta_path`` (how the tests simulate an absent one) reads as absent too.
    """
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # blocked, or in sys.modules as None
        return False


def install_hint(package: str) -> str:
    """``pip install 'hf-memwatch[extra]'`` for ``package``."""
    return f"pip install 'hf-memwatch[{EXTRAS[package][0]}]'"


def off_line(package: str, what: str | None = None) -> str:
    """The one line saying what is off without ``package`` and how to turn it on."""
    return f"{what or EXTRAS[package][1]} is off: {package} is not installed ({install_hint(package)})"


class MissingExtra(MemWatchConfigError):
    """A feature asked for explicitly needs an optional package that is not installed (one line)."""


def require(package: str, what: str | None = None) -> None:
    """Raise :class:`MissingExtra` (one line, with the ``pip install``) when ``package`` is absent."""
    if not installed(package):
        raise MissingExtra(off_line(package, what))
