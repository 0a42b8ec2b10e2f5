"""Probes: each private name, attribute or signature of another library that a feature relies on,
checked at the feature's first use.

A :class:`Probe` names the library, the private thing it checks (``guards``) and the feature that is
off without it (``off``). :func:`holds` runs a probe once per process; a failed probe (its check
false, or raising) is one WARNING naming the library, its version and what is off, and an entry of
:func:`degraded`, which the run's ``meta`` timeline record carries (``degraded``). The feature then
takes its documented fallback — never a silently different byte count, never a traceback.

Example:
    >>> gone = Probe("torch", "torch.no_such_thing", "an example feature", lambda: False)
    >>> gone.entry()  # doctest: +ELLIPSIS
    'torch 2...: torch.no_such_thing is gone, an example feature is off'
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import MemWatchConfigError
from .versions import installed

logger = logging.getLogger("hf_memwatch")


@dataclass(frozen=True)
class Probe:
    """One private thing of ``library`` (``guards``) that the feature ``off`` needs; ``check()`` is
    True while it is there as verified."""

    library: str
    guards: str
    off: str
    check: Callable[[], bool]

    def entry(self) -> str:
        return f"{self.library} {installed(self.library) or '?'}: {self.guards} is gone, {self.off} is off"


_results: dict[tuple[str, str], bool] = {}
_degraded: list[str] = []


def holds(probe: Probe) -> bool:
    """Whether ``probe`` holds; run once per process (per library and guarded name), warned once."""
    key = (probe.library, probe.guards)
    if key not in _results:
        try:
            ok = bool(probe.check())
        except Exception:  # noqa: BLE001 - a probe that cannot run has failed
            ok = False
        _results[key] = ok
        if not ok:
            entry = probe.entry()
            _degraded.append(entry)
            logger.warning("hf-memwatch: %s (this release of %s is not verified: docs/compat.md)",
                           entry, probe.library)
    return _results[key]


def require(probe: Probe) -> None:
    """For a private thing no feature can do without (the tracker's storage identity...): one
    :class:`MemWatchConfigError` line naming the library, its release and what cannot run, instead
    of a WARNING; checked once per process like :func:`holds`."""
    key = (probe.library, probe.guards)
    if key not in _results:
        try:
            _results[key] = bool(probe.check())
        except Exception:  # noqa: BLE001 - a probe that cannot run has failed
            _results[key] = False
    if not _results[key]:
        raise MemWatchConfigError(f"{probe.entry()}: hf-memwatch cannot run on this release of {probe.library} "
                                  "(verified releases: docs/compat.md)")


def degraded() -> list[str]:
    """The failed probes of this process, one line each (the ``meta`` record's ``degraded``)."""
    return list(_degraded)


def forget() -> None:
    """Run every probe again at its next use (tests that remove an upstream name)."""
    _results.clear()
    _degraded.clear()
