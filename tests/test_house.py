"""The house rules of the package, checked on the tree as it is (issue #20's measures).

- Layering: ``core -> measure -> estimation -> planning -> reporting / integration / cli``; a module
  imports only from its own floor or a lower one (imports inside functions included), and the library
  never imports ``testing`` (the suite's oracles).
- Sizes: no module over 500 lines, no function over 80 lines, none over 12 parameters except the
  ``estimate`` facade (its keywords are the public API).
- The README's layout table names every module of each subpackage.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_memwatch"
FLOORS = {"core": 0, "measure": 1, "estimation": 2, "planning": 3, "reporting": 4, "integration": 4, "cli": 4}
LONGEST_MODULE, LONGEST_FUNCTION, MOST_PARAMETERS = 500, 80, 12
PARAMETER_EXCEPTIONS = {("estimation/estimate.py", "estimate")}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _subpackage(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def imported_subpackages(source: str, own: str | None) -> set[str]:
    """Subpackages of hf_memwatch that a module of ``own`` imports (relative or absolute, at any depth)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 and own:
                found.add(own)
            elif node.level >= 2 and module:
                found.add(module.split(".")[0])
            elif module.startswith("hf_memwatch."):
                found.add(module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("hf_memwatch."))
    return found


def upward(own: str, targets: set[str]) -> list[str]:
    """The subpackages in ``targets`` a module of ``own`` must not import."""
    return sorted(t for t in targets if t == "testing" or FLOORS.get(t, -1) > FLOORS[own])


def upward_imports() -> list[str]:
    bad = []
    for path in _modules():
        own = _subpackage(path)
        if own in FLOORS:
            bad.extend(f"{path.relative_to(PACKAGE)} imports {target}"
                       for target in upward(own, imported_subpackages(path.read_text(), own)))
    return bad


def oversized() -> list[str]:
    found = []
    for path in _modules():
        name = path.relative_to(PACKAGE).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > LONGEST_MODULE:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            length = node.end_lineno - node.lineno + 1
            if length > LONGEST_FUNCTION:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
            args = node.args
            count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
            count -= bool(args.args) and args.args[0].arg in ("self", "cls")
            if count > MOST_PARAMETERS and (name, node.name) not in PARAMETER_EXCEPTIONS:
                found.append(f"{name}:{node.lineno} {node.name}: {count} parameters")
    return found


def test_no_module_imports_from_a_higher_floor() -> None:
    assert upward_imports() == []


def test_the_layering_check_sees_an_upward_import_inside_a_function() -> None:
    source = "from .units import x\n\ndef f():\n    from ..integration.callback import MemWatch\n"
    assert upward("core", imported_subpackages(source, "core")) == ["integration"]
    assert upward("cli", imported_subpackages("import hf_memwatch.testing.truth\n", "cli")) == ["testing"]
    assert upward("planning", imported_subpackages("from ..estimation import estimate\n", "planning")) == []


def test_modules_and_functions_stay_small() -> None:
    assert oversized() == []


@pytest.mark.parametrize("subpackage", sorted(set(FLOORS) | {"testing"}))
def test_the_readme_layout_table_names_every_module(subpackage: str) -> None:
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith(f"| `{subpackage}/` |"))
    named = set(re.findall(r"`(\w+)`", row.split("|", 2)[2]))
    modules = {p.stem for p in (PACKAGE / subpackage).glob("*.py") if p.stem not in ("__init__", "__main__")}
    assert modules - named == set(), f"modules the README's layout table does not name: {sorted(modules - named)}"


def test_the_readme_is_short_above_its_reference_part_and_states_the_gpu_status() -> None:
    """For a newcomer: under 150 lines before ``# Reference`` (the rest lives in docs/), and that no GPU
    has verified the CUDA paths said near the top, not mid-paragraph."""
    lines = (ROOT / "README.md").read_text().splitlines()
    reference = lines.index("# Reference")
    assert reference < 150, f"{reference} lines above the reference part"
    assert any("No GPU has verified" in line for line in lines[:20])
    for name in re.findall(r"\(docs/([\w-]+\.md)\)", "\n".join(lines[:reference])):
        assert (ROOT / "docs" / name).is_file(), name
