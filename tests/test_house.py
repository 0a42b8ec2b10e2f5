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
FLOORS = {"compat": 0, "core": 0, "measure": 1, "estimation": 2, "planning": 3, "reporting": 4, "integration": 4, "cli": 4,
          "engines": 2}
# engines/ spans the floors (its package doc): a module serves one layer and sits on that layer's floor, read
# off its name; every other module of engines/ (the replay rules, the registry) is on estimation's floor.
ENGINE_FLOORS = {"engine": 0, "gloo_staging": 1, "live": 1}
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
    return sorted(t for t in targets if t == "testing" or floor(t) > floor(own))


def floor(module: str) -> int:
    """The floor of a subpackage (``estimation``) or of a module (``engines.zero.step``)."""
    parts = module.split(".")
    if parts[0] == "engines" and len(parts) > 1:
        return ENGINE_FLOORS.get(parts[-1], FLOORS["engines"])
    return FLOORS.get(parts[0], -1)


def imported_modules(source: str, own: str) -> set[str]:
    """The modules of hf_memwatch (dotted below it: ``engines.zero.step``) that module ``own`` imports,
    at any depth; a name imported from a package counts as its submodule where one of that name exists."""
    found: set[str] = set()
    package = own.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif (node.module or "").startswith("hf_memwatch."):
                base = node.module.split(".")[1:]
            else:
                continue
            subs = [".".join((*base, a.name)) for a in node.names
                    if (PACKAGE.joinpath(*base, f"{a.name}.py")).is_file() or PACKAGE.joinpath(*base, a.name).is_dir()]
            found.update(subs or [".".join(base)])
        elif isinstance(node, ast.Import):
            found.update(".".join(a.name.split(".")[1:]) for a in node.names if a.name.startswith("hf_memwatch."))
    return {name for name in found if name}


def upward_imports() -> list[str]:
    bad = []
    for path in _modules():
        own = _subpackage(path)
        if own in FLOORS:
            name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
            bad.extend(f"{path.relative_to(PACKAGE)} imports {target}"
                       for target in sorted(imported_modules(path.read_text(), name))
                       if target.split(".")[0] == "testing" or floor(target) > floor(name))
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
    named = set(re.findall(r"`([\w/]+)`", row.split("|", 2)[2]))
    modules = {p.relative_to(PACKAGE / subpackage).with_suffix("").as_posix()
               for p in (PACKAGE / subpackage).rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert modules - named == set(), f"modules the README's layout table does not name: {sorted(modules - named)}"


# -- other libraries' private names live in hf_memwatch/compat/ (issue #33) ---------------------------
# What each module still reaches into, counted by foreign_private_accesses(); the migration into compat/
# shrinks it (lower a count when you move one; a new private access outside compat/ fails the test).
# No private name of another library outside compat/ (issue #33: 139 accesses in 41 modules before the
# migration, 115 in 36 before compat/, 19 in 7 engines' modules before the last of them moved).


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(trees: list[ast.AST]) -> set[str]:
    """Names hf-memwatch itself defines: functions, classes, module and class variables, ``self.``/
    ``cls.`` attributes and marks it sets with ``setattr``; a private name outside these is another
    library's."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                own.add(str(node.args[1].value))
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_hf_memwatch"):
                own.add(node.attr)  # our own mark on another library's object
    return own


def private_accesses(tree: ast.AST, own: set[str]) -> list[str]:
    """Another library's private names a module uses: imports from a private module or of a private
    name, ``x._name`` (one per attribute chain), ``getattr``/``hasattr``/``setattr(x, "_name")``."""
    found: list[str] = []
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and not (node.module or "").startswith("hf_memwatch"):
            if any(map(_private, (node.module or "").split("."))) or any(_private(a.name) for a in node.names):
                found.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found.extend(f"import {a.name}" for a in node.names if any(map(_private, a.name.split("."))))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            if id(node) not in inner:
                found.append(f".{node.attr}")
            value = node.value
            while isinstance(value, ast.Attribute):  # torch._C._foo: one access
                inner.add(id(value))
                value = value.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in own):
            found.append(f"{node.func.id}(..., {node.args[1].value!r})")
    return found


def foreign_private_accesses() -> dict[str, list[str]]:
    """Per module outside ``compat/``: the private names of other libraries it uses."""
    trees = {path: ast.parse(path.read_text()) for path in _modules()}
    own = _own_names(list(trees.values()))
    found = {}
    for path, tree in trees.items():
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith("compat/") and (accesses := private_accesses(tree, own)):
            found[name] = accesses
    return found


def test_no_private_access_of_another_library_outside_compat() -> None:
    assert foreign_private_accesses() == {}, (
        "a private name of another library belongs in hf_memwatch/compat/ (with a probe)")


def test_the_private_access_check_sees_a_new_one() -> None:
    source = ("from torch.utils._python_dispatch import _pop_mode\nimport torch\n"
              "def f(trainer, t):\n    trainer._train_batch_size = 1\n    return torch._C._foo(t), getattr(t, '_x')\n")
    assert sorted(private_accesses(ast.parse(source), own={"f"})) == [
        "._foo", "._train_batch_size", "from torch.utils._python_dispatch import _pop_mode", "getattr(..., '_x')"]


def test_the_readme_is_short_above_its_reference_part_and_states_the_gpu_status() -> None:
    """For a newcomer: under 150 lines before ``# Reference`` (the rest lives in docs/), and that no GPU
    has verified the CUDA paths said near the top, not mid-paragraph."""
    lines = (ROOT / "README.md").read_text().splitlines()
    reference = lines.index("# Reference")
    assert reference < 150, f"{reference} lines above the reference part"
    assert any("No GPU has verified" in line for line in lines[:20])
    for name in re.findall(r"\(docs/([\w-]+\.md)\)", "\n".join(lines[:reference])):
        assert (ROOT / "docs" / name).is_file(), name


# -- engines: one folder each, no engine named outside hf_memwatch/engines/ (issue #34) ------------
# An engine's names (``Engine.kind``, ``Engine.shard``, accelerate's ``distributed_type``) and the settings
# only an engine has: outside engines/, a module asks the registry (engines/registry.py), never checks one.
ENGINE_NAMES = {"deepspeed", "fsdp", "fsdp1", "fsdp2", "ddp", "zero", "zero1", "zero2", "zero3", "zero++", "mics",
                "multi_gpu", "multi_cpu"}
ENGINE_SETTINGS = {"zero_stage", "fsdp_version", "fsdp_strategy", "fsdp_wrap", "fsdp_cpu_offload", "offload_optimizer",
                   "offload_param", "engine_optimizer", "cpu_optimizer", "reduce_bucket_size", "allgather_bucket_size",
                   "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold", "max_reuse_distance",
                   "is_deepspeed_enabled", "is_fsdp_enabled", "is_fsdp2", "deepspeed_plugin", "fsdp_plugin",
                   "distributed_type", "ds_tensor"}
# Not an engine check: the name of a package (the ``deepspeed`` extra, its verified versions, its compat home).
ENGINE_NAME_EXCEPTIONS = {("core/extras.py", "deepspeed"), ("compat/versions.py", "deepspeed"),
                          ("compat/deepspeed.py", "deepspeed")}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def engine_checks(source: str, name: str = "") -> list[str]:
    """What in ``source`` names an engine: a string that is an engine's name (docstrings aside), an
    engine-only setting read (``x.zero_stage``, ``getattr(x, "fsdp_plugin")``)."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                and node.value.lower() in ENGINE_NAMES and (name, node.value.lower()) not in ENGINE_NAME_EXCEPTIONS):
            found.append(f"{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in ENGINE_SETTINGS:
            found.append(f"{node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_SETTINGS):
            found.append(f"{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_engine_is_named_outside_the_engines_package() -> None:
    """Adding an engine is one folder and one registry line: no module of the library but engines/ (the
    suite's oracles in testing/ aside) checks an engine's kind or reads an engine's own settings."""
    found = {}
    for path in _modules():
        name = path.relative_to(PACKAGE).as_posix()
        if name.startswith(("engines/", "testing/")):
            continue
        if checks := engine_checks(path.read_text(), name):
            found[name] = checks
    assert found == {}, f"engine checks outside hf_memwatch/engines/ (ask engines/registry.py): {found}"


def test_the_engine_check_sees_a_new_one() -> None:
    source = ('"""FSDP or ddp in a docstring is prose."""\n'
              'def f(run, engine, args):\n    """Not "fsdp" here."""\n'
              '    if engine.kind == "fsdp" and run.shard.startswith("zero"):\n'
              '        return engine.zero_stage, getattr(args, "fsdp_plugin", None)\n'
              '    return run.shard != "none"\n')
    assert engine_checks(source) == ["4: 'fsdp'", "4: 'zero'", "5: .zero_stage", "5: getattr(..., 'fsdp_plugin')"]


# -- no import cycle at any level, imports inside functions included (issue #34 point 4) ---------------
def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph_imports(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The hf_memwatch modules ``module`` imports, at module level or inside a function (``known``: every
    module's dotted name; ``from .x import name`` counts ``.x.name`` when that is a module)."""
    package = module if is_package else module.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.update(name for name in (target, *(f"{target}.{a.name}" for a in node.names)) if name in known)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in _modules()}
    known = set(paths)
    return {name: graph_imports(path.read_text(), name, path.name == "__init__.py", known)
            for name, path in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(frozenset(group))
    return cycles


# Cycles still there, each with why; this list may only shrink (a new cycle fails, a fixed one must go).
CYCLES_ALLOWED: set[frozenset[str]] = set()  # none left (issue #34 point 4); may only stay empty


def test_no_import_cycle_at_any_level() -> None:
    cycles = set(import_cycles(import_graph()))
    assert cycles - CYCLES_ALLOWED == set(), "new import cycles (imports inside functions count)"
    assert CYCLES_ALLOWED - cycles == set(), "a cycle that is gone must leave CYCLES_ALLOWED"


def test_the_cycle_check_sees_an_import_inside_a_function() -> None:
    known = {"p.a", "p.b", "p.c"}
    graph = {"p.a": graph_imports("from .b import f\n", "p.a", False, known),
             "p.b": graph_imports("def g():\n    from . import a\n", "p.b", False, known),
             "p.c": graph_imports("import p.a\n", "p.c", False, known)}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": {"p.a"}}
    assert import_cycles(graph) == [frozenset({"p.a", "p.b"})]
    assert import_cycles({"p.a": {"p.b"}, "p.b": set()}) == []


# -- a test file names every module (issue #34 point 4) -------------------------------------------------
# Modules no tests/test_*.py file imports or names, each with where it is exercised; may only shrink.
UNNAMED_ALLOWED = {
    "hf_memwatch.estimation.peak": "estimate(top_tensors=...): tests/test_peak_tensors.py",
    "hf_memwatch.estimation.rebind": "TRL's patched forwards rebound in the fake copy: tests/test_gkd_auto.py",
    "hf_memwatch.estimation.trl_replay": "TRL's generating steps: tests/test_trl_online.py, test_gkd_auto.py",
    "hf_memwatch.integration.trials": "hyperparameter_search: its doctest and tests/test_runs.py",
    "hf_memwatch.measure.batches": "the formed batches counted: tests/test_batches_as_formed.py",
    "hf_memwatch.measure.cuda_context": "CUDA only; tests/test_cuda_hygiene.py",
    "hf_memwatch.measure.peak_watch": "the peak_tensors records: tests/test_peak_tensors.py",
    "hf_memwatch.engines.ddp.live": "DDP's buckets on live gloo ranks: tests/engines/test_distributed.py (torchrun)",
    "hf_memwatch.engines.zero.advice": "ZeRO advice per rank: tests/engines/test_deepspeed_zero.py, test_cli_estimate.py",
    "hf_memwatch.engines.gloo_staging": "gloo ranks: tests/engines/test_distributed.py (torchrun)",
    "hf_memwatch.reporting.eval_oom": "an OOM in an eval loop: tests/test_eval.py",
}


def _test_sources() -> str:
    """Every test file but this one (its lists name modules without testing them)."""
    return "\n".join(path.read_text() for path in sorted((ROOT / "tests").rglob("test_*.py"))
                     if path.name != "test_house.py")


def names_module(text: str, dotted: str) -> bool:
    """Whether ``text`` imports or names the module ``dotted`` (``a.b.c``): its dotted name, its path,
    or ``from a.b import ..., c, ...``."""
    parts = dotted.split(".")
    package, stem = ".".join(parts[:-1]), parts[-1]
    return bool(re.search(rf"{re.escape(dotted)}\b|{re.escape('/'.join(parts))}\.py", text)
                or re.search(rf"from {re.escape(package)} import (\([^)]*|[^(\n]*)\b{stem}\b", text))


def unnamed_modules() -> set[str]:
    text = _test_sources()
    names = {_module_name(path) for path in _modules() if path.stem not in ("__init__", "__main__")}
    return {name for name in names if not names_module(text, name)}


def test_a_test_file_names_every_module() -> None:
    unnamed = unnamed_modules()
    assert unnamed - set(UNNAMED_ALLOWED) == set(), "modules no tests/test_*.py names: add a test (or say why)"
    assert set(UNNAMED_ALLOWED) - unnamed == set(), "named now (or gone): remove it from UNNAMED_ALLOWED"


def test_the_naming_check_reads_imports_and_paths() -> None:
    assert names_module("from hf_memwatch.integration.session import RunSession", "hf_memwatch.integration.session")
    assert names_module("from hf_memwatch.integration import (\n    session,\n)", "hf_memwatch.integration.session")
    assert names_module("from hf_memwatch.integration import auto, session", "hf_memwatch.integration.session")
    assert names_module("see hf_memwatch/integration/session.py", "hf_memwatch.integration.session")
    assert not names_module("from hf_memwatch.integration.sessions import x", "hf_memwatch.integration.session")
    assert not names_module("RunSession()", "hf_memwatch.integration.session")
