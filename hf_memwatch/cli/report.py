"""``hf-memwatch report <timeline.jsonl or output dir>... -o memory.png|memory.html``: draw a run's memory
(several runs: side by side, to compare).

Example:
    $ hf-memwatch report runs/gpt2 -o memory.png
    wrote memory.png (2 ranks, 40 steps)
    $ hf-memwatch report runs/before runs/after -o compare.png
    wrote compare.png (2 ranks of 2 runs, 40 steps)
    $ hf-memwatch report runs/gpt2 -o memory.png --x seconds    # x: wall-clock seconds
"""

from __future__ import annotations

import argparse
import sys

from ..core.units import parse_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hf-memwatch report``."""
    parser.add_argument("path", nargs="+", help="a timeline.jsonl, a memwatch folder or a Trainer output_dir; "
                                                "two or more: the runs side by side, to compare")
    parser.add_argument("-o", "--output", default="memory.png", help="memory.png or memory.html (default: %(default)s)")
    parser.add_argument("--budget", default=None, help="draw this budget line (e.g. 20GiB) instead of the plan's")
    parser.add_argument("--x", dest="x_axis", choices=("steps", "seconds"), default="steps",
                        help="the picture's x-axis: optimizer steps, one band per phase (default), or wall-clock "
                             "seconds since the first snapshot (the page has buttons for both)")


def check_arguments(args: argparse.Namespace) -> None:
    """A path with no timeline, a wrong suffix or budget: one actionable line, before any drawing."""
    from pathlib import Path

    from ..core.errors import MemWatchConfigError
    from ..core.timeline import find_timelines

    if Path(args.output).suffix.lower() not in (".png", ".html", ".htm"):
        raise MemWatchConfigError(f"-o must end in .png (the picture) or .html (the page); got {args.output!r}")
    if args.budget is not None:
        parse_bytes(args.budget, what="--budget")
    for path in args.path:
        if not Path(path).exists():
            raise MemWatchConfigError(f"{path}: no such file or folder")
        if not find_timelines(path):
            raise MemWatchConfigError(
                f"no timeline*.jsonl under {path}: give the output_dir of a Trainer run with MemWatch() (its "
                "memwatch/ folder holds the timeline), that memwatch/ folder, or a timeline.jsonl")


def run(args: argparse.Namespace) -> int:
    """Write the picture; ``MemWatchConfigError`` / ``FileNotFoundError`` become one stderr line (cli)."""
    from ..reporting.report import load_runs, write_report

    budget = parse_bytes(args.budget, what="--budget") if args.budget is not None else None
    notes: list[str] = []
    out = write_report(args.path, args.output, budget=budget, notes=notes, x_axis=args.x_axis)
    for note in notes:  # an optional package missing: what is off, how to turn it on, what stands in
        print(f"hf-memwatch report: {note}", file=sys.stderr)
    runs = load_runs(args.path)
    skipped = [line for run in runs for line in run.skipped]
    if skipped:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        print(f"hf-memwatch report: skipped {len(skipped)} malformed record{'s' if len(skipped) > 1 else ''}: "
              f"{skipped[0]}{more}", file=sys.stderr)
    steps = max((len(r.steps) for r in runs), default=0)
    ranks = f"{len(runs)} rank{'s' if len(runs) > 1 else ''}" + (f" of {len(args.path)} runs" if len(args.path) > 1 else "")
    print(f"wrote {out} ({ranks}, {steps} steps)")
    return 0
