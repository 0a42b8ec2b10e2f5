"""The one check at the first ``MemWatch()``, ``estimate`` or CLI call: the libraries' versions
(:func:`~hf_memwatch.compat.versions.check_versions`), then torch's internals that nothing runs without
(:func:`~hf_memwatch.compat.torch_internals.check`); each fails fast in one ``MemWatchConfigError`` line.

Kept apart from ``versions`` so that ``versions`` (read by every probe) imports no torch internals.

Example:
    >>> check_stack()  # the installed stack is the verified one: nothing to say
"""

from __future__ import annotations

from . import torch_internals
from .versions import check_versions


def check_stack() -> None:
    """Versions first (an old torch would fail the internals' check with a less useful line), then torch's
    internals; both cached, so a process checks once."""
    check_versions()
    torch_internals.check()
