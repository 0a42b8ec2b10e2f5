"""hf_memwatch.cli.report: ``hf-memwatch report``'s arguments, each wrong one a single line before any drawing
(tests/test_report.py runs the command on a real run)."""

from __future__ import annotations

import argparse

import pytest

from hf_memwatch.cli.report import add_arguments, check_arguments
from hf_memwatch.core.errors import MemWatchConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_defaults_are_the_picture_on_steps() -> None:
    args = _args("out")
    assert (args.path, args.output, args.budget, args.x_axis) == (["out"], "memory.png", None, "steps")


@pytest.mark.parametrize(("argv", "message"), [
    (("{run}", "-o", "memory.pdf"), "-o must end in .png"),
    (("{run}", "--budget", "lots"), "--budget"),
    (("{run}/missing",), "no such file or folder"),
    (("{empty}",), "no timeline\\*.jsonl under"),
])
def test_a_wrong_argument_is_one_line(tmp_path, argv: tuple[str, ...], message: str) -> None:
    run, empty = tmp_path / "run", tmp_path / "empty"
    run.mkdir(), empty.mkdir()
    (run / "timeline.jsonl").write_text("")
    args = _args(*(a.format(run=run, empty=empty) for a in argv))
    with pytest.raises(MemWatchConfigError, match=message) as caught:
        check_arguments(args)
    assert "\n" not in str(caught.value)


def test_a_run_folder_with_a_timeline_passes(tmp_path) -> None:
    (tmp_path / "timeline.jsonl").write_text("")
    check_arguments(_args(str(tmp_path), "-o", str(tmp_path / "memory.html"), "--budget", "8GiB"))
