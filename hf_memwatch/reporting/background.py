"""Draw ``memory.png`` in a separate, low-priority process so that ``train()`` does not wait for it.

Drawing the picture (importing matplotlib, laying out and rasterising the figure) costs about a
second, more than a small ``train()`` itself. At train end MemWatch starts this module as a detached
child process (``python -m hf_memwatch.reporting.background <timeline dir> <out>``) and returns at
once; the picture appears when it is ready. It is drawn in a private temporary folder and only then
copied beside ``out`` under a temporary name and renamed, so a reader never sees a half-written file
and the run's folder gets new files only in the last milliseconds. The child never creates folders:
when the run's folder was removed meanwhile (a ``TemporaryDirectory`` left, a sweep cleaning up after
``train()`` returned), nothing is written and the folder stays gone. A failure is written to
``<out>.log`` when the folder still exists (nothing is printed: the run that started the process may
already be printing something else, or be gone).

Usage:
    >>> process = start_report_process("out/memwatch", "out/memwatch/memory.png")   # doctest: +SKIP
    >>> wait_for_report(process, timeout=60)                                         # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# The child shares the CPUs with whatever the parent does next (the next trial of a hyperparameter
# search, evaluation), whose torch threads slow down as a whole when one of them loses its core:
# on Linux the child runs under SCHED_IDLE (only on otherwise idle CPUs), elsewhere at the lowest
# priority.
NICENESS = 19


def start_report_process(directory: str | os.PathLike[str], out: str | os.PathLike[str]) -> subprocess.Popen:
    """Start drawing the run under ``directory`` into ``out`` in a detached child; returns the process.

    The child finds this package where the parent found it (its folder goes first on ``PYTHONPATH``),
    outlives the parent (its own session: Ctrl-C of a notebook or script does not cut it), and writes
    nothing to the parent's console.
    """
    package_root = str(Path(__file__).resolve().parents[2])  # the folder holding hf_memwatch/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
        [sys.executable, "-m", __name__, str(directory), str(out)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        close_fds=True,
        start_new_session=True,
    )


def wait_for_report(process: subprocess.Popen, timeout: float | None = None) -> bool:
    """Wait until the child exits; True when it drew the picture (exit status 0).

    False on a failure (the reason is in ``<out>.log``) or when ``timeout`` passed first.
    """
    try:
        return process.wait(timeout=timeout) == 0
    except subprocess.TimeoutExpired:
        return False


def draw_atomically(directory: str, out: str) -> Path | None:
    """Draw in a private temporary folder, then copy beside ``out`` and rename to ``out``.

    Returns ``out``, or None when its folder no longer exists (removed after ``train()`` returned):
    then nothing is written and no folder is created again.
    """
    from .report import write_report

    target = Path(out)
    with tempfile.TemporaryDirectory(prefix="hf-memwatch-report-") as scratch:
        drawn = write_report(directory, Path(scratch) / target.name)
        target = target.with_name(drawn.name)  # the steps table (.html) where no picture can be drawn
        if not target.parent.is_dir():
            return None
        partial = target.with_name(f".{target.stem}.partial{target.suffix}")
        try:
            shutil.copyfile(drawn, partial)
            os.replace(partial, target)
        except FileNotFoundError:  # the folder went away while copying: leave nothing behind
            partial.unlink(missing_ok=True)
            return None
    return target


def lower_priority() -> None:
    """Take only idle CPU time (SCHED_IDLE on Linux, else the lowest nice level; best effort)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.nice(NICENESS)
    except (AttributeError, OSError):  # not on this platform, or not allowed: normal priority
        pass


def main(argv: list[str]) -> int:
    directory, out = argv
    lower_priority()
    try:
        draw_atomically(directory, out)
    except Exception:  # noqa: BLE001 - a picture must never fail anything; say why in a file instead
        log = Path(f"{out}.log")
        if log.parent.is_dir():  # not into a folder removed meanwhile (and never creating it again)
            log.write_text(traceback.format_exc(), encoding="utf-8")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
