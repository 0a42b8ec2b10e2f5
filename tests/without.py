"""Run Python as if some packages were not installed: ``python tests/without.py PKG[,PKG] -m MODULE ARGS`` or
``python tests/without.py PKG[,PKG] SCRIPT ARGS``.

Every finder on ``sys.meta_path`` is wrapped so that it finds nothing for the blocked packages (and
their submodules): ``import PKG`` raises ``ModuleNotFoundError("No module named 'PKG'")`` and
``importlib.util.find_spec("PKG")`` is None — how an absent package behaves to ``import`` and to the
availability checks of transformers and of :mod:`hf_memwatch.core.extras`. Child processes do not
inherit the block.
"""

from __future__ import annotations

import runpy
import sys


class Blocking:
    """A ``sys.meta_path`` finder that hides ``blocked`` from the finder it wraps."""

    def __init__(self, inner, blocked: set[str]) -> None:
        self.inner, self.blocked = inner, blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)

    def find_distributions(self, *args, **kwargs):
        """The installed distributions (``importlib.metadata``), the blocked ones left out."""
        find = getattr(self.inner, "find_distributions", None)
        for dist in [] if find is None else find(*args, **kwargs):
            if (dist.metadata["Name"] or "").lower().replace("-", "_") not in self.blocked:
                yield dist

    def __getattr__(self, name):  # invalidate_caches and the rest: the wrapped finder's
        return getattr(self.inner, name)


def block(packages: set[str]) -> None:
    """Hide ``packages`` from every finder now on ``sys.meta_path`` (none of them may be imported yet)."""
    loaded = sorted(name for name in sys.modules if name.partition(".")[0] in packages)
    if loaded:
        raise RuntimeError(f"already imported: {loaded}")
    sys.meta_path[:] = [Blocking(finder, packages) for finder in sys.meta_path]


def main(argv: list[str]) -> None:
    packages, *rest = argv
    block(set(packages.split(",")))
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
