"""The home of other libraries' internals: the versions hf-memwatch is verified on (``versions``),
the probes that check a private name at first use and switch off only what depends on it, loudly
(``probes``), and the private things themselves, one module per library (``trainer``: transformers'
Trainer and callbacks; ``torch_frames``: torch's C++ frame names). docs/compat.md has the matrix.
"""

from .probes import degraded
from .versions import check_versions

__all__ = ["check_versions", "degraded"]
