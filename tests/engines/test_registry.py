"""hf_memwatch.engines.registry: the one table of engines and what its callers ask it (issue #34)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.engines.engine import SHARDS
from hf_memwatch.engines.registry import ENGINES, engine_of_options, rules_for

ROOT = Path(__file__).resolve().parents[2]


def test_every_shard_name_belongs_to_exactly_one_engine() -> None:
    """``SHARDS`` (what the CLI checks before importing torch) is the engines' own names, each answered
    by one engine on 2 ranks; ``none`` is DDP on 2 ranks and one process on one."""
    named = {"none"} | {shard for rules in ENGINES for shard in rules.shards}
    assert set(SHARDS) == named
    for shard in SHARDS:
        assert sum(rules.answers(shard, 2) for rules in ENGINES[:-1]) == 1, shard
    assert rules_for("none", 2).name == "ddp" and rules_for("none", 1).name == "single"
    assert [rules.name for rules in ENGINES][-1] == "single"


def _options(**flags: object) -> argparse.Namespace:
    base = {"shard": "none", "world_size": 1, "offload": "none", "reduce_bucket_size": None,
            "prefetch_bucket_size": None, "max_live_parameters": None, "max_reuse_distance": None}
    return argparse.Namespace(**{**base, **flags})


def test_the_cli_flags_become_the_engine_of_their_shard() -> None:
    zero3 = engine_of_options(_options(shard="zero3", world_size=2, offload="params", reduce_bucket_size=1e5))
    assert (zero3.kind, zero3.shard, zero3.offload, zero3.reduce_bucket_size) == ("deepspeed", "zero3", "params", 100_000)
    fsdp = engine_of_options(_options(shard="fsdp", world_size=4))
    assert (fsdp.kind, fsdp.fsdp_version, fsdp.shard, fsdp.world_size) == ("fsdp", 2, "fsdp", 4)
    assert engine_of_options(_options(world_size=2)) is None  # DDP: plain values
    with pytest.raises(MemWatchConfigError, match="--offload needs --shard zero1/zero2/zero3"):
        engine_of_options(_options(shard="fsdp", world_size=2, offload="optimizer"))


_FIRST = """
import importlib, json, sys
import torch, transformers  # the heavy dependencies once; hf_memwatch's modules are dropped between imports
failed = {}
for name in json.loads(sys.argv[1]):
    for key in [k for k in sys.modules if k == "hf_memwatch" or k.startswith("hf_memwatch.")]:
        del sys.modules[key]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = repr(exc)[:200]
print(json.dumps(failed))
"""


def _engine_side_modules() -> list[str]:
    """Every module of engines/, and every module of the library that imports one (or estimation's
    package, which the engines' replay rules import)."""
    names = []
    for path in sorted((ROOT / "hf_memwatch").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        text = path.read_text()
        if ".engines" in name or "engines." in text or name.startswith("hf_memwatch.estimation"):
            names.append(name)
    return names


def test_each_engine_module_and_its_callers_import_first() -> None:
    """No import cycle through a package: each module imported first, in a fresh ``sys.modules`` (an
    engine module imported before ``estimation`` failed, half-initialized, while ``estimation/__init__``
    imported the facade with the package)."""
    names = _engine_side_modules()
    assert "hf_memwatch.engines.zero.backward" in names and "hf_memwatch.integration.session" in names
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _FIRST, json.dumps(names)], capture_output=True,
                         text=True, cwd=ROOT, timeout=600, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}


def test_the_table_holds_one_instance_of_each_engines_rules_the_base_last() -> None:
    """Each engine folder's ``rules`` class has one line in the table; the base (one process) is the
    fallback, so it must come last and answer no shard name itself."""
    from hf_memwatch.engines.ddp.rules import DdpRules
    from hf_memwatch.engines.fsdp2.rules import Fsdp2Rules
    from hf_memwatch.engines.rules import EngineRules
    from hf_memwatch.engines.zero.rules import ZeroRules

    kinds = [type(rules) for rules in ENGINES]
    assert len(set(kinds)) == len(kinds) and {DdpRules, ZeroRules, Fsdp2Rules, EngineRules} <= set(kinds)
    assert kinds[-1] is EngineRules and all(isinstance(rules, EngineRules) for rules in ENGINES)
    assert EngineRules.shards == () and not any(EngineRules().answers(shard, 2) for shard in SHARDS)
    assert type(rules_for("zero2", 4)) is ZeroRules and type(rules_for("none", 8)) is DdpRules
    assert ZeroRules.shards == ("zero1", "zero2", "zero3") and Fsdp2Rules.shards == ("fsdp",)


def test_the_base_rules_are_one_process_holding_nothing_beside_the_model() -> None:
    """One process: no contributor on a live rank, no advice, no engine remedies to refuse, the step its own."""
    from hf_memwatch.engines.rules import EngineRules

    base = EngineRules()
    assert base.name == "single" and base.engine_of_options(_options()) is None
    assert base.contributor(None, None) is None and base.advice(None, {}, 0, None) == []
    assert base.no_fit_reasons(None, "forward") is None and base.eight_bit_unavailable(None) is None
