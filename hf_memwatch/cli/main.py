"""``hf-memwatch`` command line: ``estimate`` (pre-flight prediction) and ``report`` (pictures).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
this module only dispatches. Bad input: one line on stderr, exit status 2, no traceback; each module's
``check_arguments(args)`` runs first, before anything heavy (torch, transformers) is imported.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from ..core.errors import MemWatchError

SUBCOMMANDS = {
    "estimate": ("hf_memwatch.cli.estimate", "predict a training step's peak memory without running it"),
    "report": ("hf_memwatch.cli.report", "draw a run's memory timeline (PNG or HTML)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2 (argparse's own convention)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog="hf-memwatch", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hf-memwatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(subcommand=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # bitsandbytes (imported through peft/transformers) logs that optional CPU kernels are missing:
    # noise for a command whose stderr is one line on error.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.subcommand.check_arguments(args)  # bad arguments answered before the heavy imports
        return int(args.subcommand.run(args) or 0)
    except (MemWatchError, OSError, ValueError, KeyError, TypeError) as exc:  # one line, never a traceback
        print(f"hf-memwatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
