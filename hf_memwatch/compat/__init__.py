"""The home of other libraries' internals: the versions hf-memwatch is verified on (``versions``),
the probes that check a private name at first use and switch off only what depends on it, loudly
(``probes``), and the private things themselves, one module per library: torch (``torch_internals``:
the dispatch mode, fake tensors, storage identity, required; ``torch_ops``: ATen's underscore
operators; ``torch_frames``: C++ frame names and reference counts; ``torch_cuda_memory``;
``torch_compile``; the CUDA replay's ``torch_dispatcher``, ``torch_amp``; DDP's in ``ddp``), transformers (``trainer``: the Trainer's attributes and callbacks;
``trainer_methods``: its private methods the replay calls; ``generation``), ``accelerate``,
``bitsandbytes``, ``datasets``, ``deepspeed``. docs/compat.md has the matrix and every probe.
"""

from .probes import degraded
from .versions import check_versions

__all__ = ["check_versions", "degraded"]
