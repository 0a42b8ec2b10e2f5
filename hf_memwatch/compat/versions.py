"""The versions of other libraries hf-memwatch is verified on, and the check at first use.

``VERIFIED`` is what the suite runs on (``make test``: the pinned stack of ``constraints.txt``;
``make test-stack2``: the second stack of ``constraints-stack2.txt``, its core subset), nothing
more: ``floor`` is the oldest release tested, ``tested`` every release a CI stack runs. A required
library older than its floor is a :class:`~hf_memwatch.core.errors.MemWatchConfigError` naming the
range (one line, at ``MemWatch()``, ``estimate`` and the CLI); an optional one (installed, older than
its floor) is one WARNING. A release newer than the last tested one runs: what changes between
releases is the other libraries' internals, and :mod:`hf_memwatch.compat.probes` checks each at its
first use, turning off only the feature that depends on it (loudly) when it is gone.

``HF_MEMWATCH_UNVERIFIED=1`` (:data:`UNVERIFIED_ENV`) runs on a required library older than its floor
anyway, said in one WARNING instead of the error: for a machine whose libraries cannot be changed — the
lent GPU machines hold torch 2.11 and no network (``docs/gpu_check.md``) — where what runs is to be seen,
not trusted. torch's internals are still checked (:mod:`.torch_internals`): what nothing runs without
still fails fast.

Example:
    >>> unsupported({"transformers": "4.46.3", "torch": "2.13.0+cpu"})
    ['transformers 4.46.3 is older than the oldest verified release (supported: transformers>=4.57 (tested: 4.57.6, 5.23.0))']
    >>> unsupported({"transformers": "5.23.0"})
    []
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

from ..core.errors import MemWatchConfigError

logger = logging.getLogger("hf_memwatch")
# Set to 1 (or true/yes): a required library older than its floor is one WARNING, not an error (module doc).
UNVERIFIED_ENV = "HF_MEMWATCH_UNVERIFIED"


@dataclass(frozen=True)
class Verified:
    """A library's verified range: ``floor`` the oldest release tested, ``tested`` those CI runs."""

    floor: str
    tested: tuple[str, ...]
    required: bool

    def supported(self) -> str:
        return f">={self.floor} (tested: {', '.join(self.tested)})"


# The two CI stacks (constraints.txt, constraints-stack2.txt); torch is 2.13 in both.
VERIFIED: dict[str, Verified] = {
    "torch": Verified("2.13", ("2.13.0",), required=True),
    "transformers": Verified("4.57", ("4.57.6", "5.23.0"), required=True),
    "accelerate": Verified("1.10", ("1.10.1", "1.15.0"), required=True),
    "trl": Verified("0.24", ("0.24.0", "1.16.0"), required=False),
    "peft": Verified("0.17", ("0.17.1", "0.21.2"), required=False),
    "deepspeed": Verified("0.19.8", ("0.19.8",), required=False),
    "bitsandbytes": Verified("0.50", ("0.50.2",), required=False),
}


def installed(library: str) -> str | None:
    """The installed release of ``library`` (its distribution's metadata, nothing imported), or None."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def _older(version: str, floor: str) -> bool:
    try:
        return Version(version).release < Version(floor).release
    except InvalidVersion:  # a local build with another scheme: the probes judge it
        return False


def _line(library: str, version: str) -> str:
    return (f"{library} {version} is older than the oldest verified release "
            f"(supported: {library}{VERIFIED[library].supported()})")


def unsupported(versions: dict[str, str | None], *, required: bool = True) -> list[str]:
    """One line per library of ``versions`` (name -> release) older than its floor, among the
    ``required`` ones (or the optional ones)."""
    return [_line(name, version) for name, version in versions.items()
            if version is not None and name in VERIFIED and VERIFIED[name].required == required
            and _older(version, VERIFIED[name].floor)]


def unverified_allowed() -> bool:
    """Whether :data:`UNVERIFIED_ENV` asks to run on libraries older than their floors."""
    return os.environ.get(UNVERIFIED_ENV, "").strip().lower() in ("1", "true", "yes")


@functools.cache
def check_versions() -> None:
    """Fail fast on a required library older than its verified floor (one ``MemWatchConfigError``
    line, the range named); WARN once on an optional one. Cached: a process checks once.
    :func:`hf_memwatch.compat.stack.check_stack` adds torch's internals that nothing runs without."""
    versions = {name: installed(name) for name in VERIFIED}
    if lines := unsupported(versions, required=True):
        if unverified_allowed():
            logger.warning("hf-memwatch: %s; running anyway (%s is set): figures on this stack are unverified",
                           "; ".join(lines), UNVERIFIED_ENV)
        else:
            check_versions.cache_clear()  # a fixed environment is checked again
            raise MemWatchConfigError("; ".join(lines) + f" (set {UNVERIFIED_ENV}=1 to run unverified anyway)")
    for line in unsupported(versions, required=False):
        logger.warning("hf-memwatch: %s; features that rely on it may be off (see the warnings that follow)", line)
