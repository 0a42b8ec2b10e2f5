"""Bad input gets one clear line and loses nothing (issue #21 point 5): MemWatch keywords, budgets,
``hf-memwatch estimate`` verdicts and warnings, ``hf-memwatch report`` on malformed timelines; with
hypothesis properties over budget strings, CLI arguments and timeline lines."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import GPT2Config

from hf_memwatch import MemWatch, MemWatchConfigError
from hf_memwatch.cli.main import main
from hf_memwatch.core.units import _UNITS, MAX_PLAUSIBLE_BYTES, parse_bytes
from hf_memwatch.measure.backends import backend_for
from hf_memwatch.planning.budget import machine_capacity, resolve_budget

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    return path


def test_unknown_keyword_is_a_config_error_naming_the_closest():
    with pytest.raises(MemWatchConfigError, match=r"unknown keyword 'budjet' \(did you mean 'budget'\?\)"):
        MemWatch(budjet="1GiB")
    with pytest.raises(MemWatchConfigError, match=r"top_tensors"):  # every keyword it takes is named
        MemWatch(top_tensor=3)


def test_unknown_estimate_keyword_is_a_config_error(model_dir):
    from hf_memwatch import estimate

    with pytest.raises(MemWatchConfigError, match=r"estimate\(\) got an unknown keyword 'seqlen' \(did you mean 'seq_len'\?\)"):
        estimate(str(model_dir), micro_batch_size=1, seqlen=8)


def test_budgets_are_parsed_strictly():
    with pytest.raises(MemWatchConfigError, match="more than any device or host has"):
        MemWatch(budget="1e30")
    with pytest.raises(MemWatchConfigError, match="more than any device or host has"):
        MemWatch(budget=10**30)
    assert MemWatch(budget="0.5").budget == "0.5"  # a fraction as text, as a float would be
    cpu = backend_for(torch.device("cpu"))
    # MemAvailable moves between two reads, so each is checked against the limit it read
    for spec in ("0.5", 0.5):
        resolved = resolve_budget(spec, cpu)
        assert resolved.binding_limit is not None
        assert resolved.total == resolved.binding_limit.available // 2 and resolved.source.startswith("0.5 of ")
    capacity = machine_capacity(cpu)
    assert capacity is not None and capacity > 0
    too_big = f"{2 * capacity // 2**20}MiB"  # twice this host's physical memory
    with pytest.raises(MemWatchConfigError, match="more than cpu has in all"):
        resolve_budget(too_big, cpu)


units = st.sampled_from(sorted(_UNITS))
numbers = st.one_of(st.integers(0, 10**20).map(str), st.floats(0, 1e40, allow_nan=False).map(repr))


@FUZZ
@given(number=numbers, unit=units, space=st.sampled_from(["", " "]))
def test_budget_strings_give_bytes_or_one_config_error(number, unit, space):
    text = f"{number}{space}{unit}"
    try:
        value = parse_bytes(text, capacity=2**30)
    except MemWatchConfigError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(value, int) and 1 <= value < MAX_PLAUSIBLE_BYTES
    if float(number) > 1 or unit:  # not a fraction: the number times the unit
        assert value == int(float(number) * _UNITS[unit.lower()])


@FUZZ
@given(text=st.text(max_size=12))
def test_any_text_is_a_budget_or_one_config_error(text):
    try:
        value = parse_bytes(text, capacity=2**30)
    except MemWatchConfigError:
        return
    assert isinstance(value, int) and 1 <= value < MAX_PLAUSIBLE_BYTES


def test_estimate_exits_non_zero_when_nothing_fits(model_dir, capsys):
    status = main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "8", "--budget", "1KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1
    assert err[0].startswith("hf-memwatch estimate: nothing fits the budget 1.00 KiB")
    assert err[2].startswith("smallest plan (micro-batch 1") and "- LoRA (peft_config=" in "\n".join(err)  # what to try
    assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "8", "--budget", "1GiB"]) == 0


def test_estimate_warns_when_the_length_exceeds_the_positions(model_dir, capsys):
    assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "100", "--json"]) == 0
    captured = capsys.readouterr()
    assert "--seq-len 100 exceeds the model's 64 positions (max_position_embeddings)" in captured.err
    assert json.loads(captured.out)["warnings"] == [captured.err.strip()]
    assert main(["estimate", str(model_dir), "--micro-batch-size", "1", "--seq-len", "64", "--json"]) == 0
    assert "warning" not in capsys.readouterr().err


TOKENS = ["--micro-batch-size", "--seq-len", "--budget", "--gradient-accumulation-steps", "--optim", "--precision", "--world-size",
          "--shard", "--lora-r", "--json", "0", "-3", "2", "8", "1e30", "0.5", "1KiB", "x", "bf16", "zero2", "", "--"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(st.sampled_from(TOKENS), max_size=5))
def test_estimate_arguments_never_traceback(model_dir, capsys, argv):
    try:
        status = main(["estimate", str(model_dir), "--seq-len", "8", "--micro-batch-size", "1", *argv])
    except SystemExit as exc:  # argparse's own one-line usage error
        status = exc.code
    assert status in (0, 1, 2)
    err = capsys.readouterr().err
    assert "Traceback" not in err


GOOD = [
    {"event": "meta", "model": "GPT2", "params": 10, "trainable_params": 10, "batch_size": 2,
     "gradient_accumulation_steps": 1, "precision": "fp32", "optim": "adamw_torch", "world_size": 1},
    {"event": "snapshot", "step": 1, "micro_step": 0, "phase": "step_begin", "allocated": 100, "peak": 120,
     "reserved": 100, "live": {"weights": 60, "gradients": 0, "optimizer_states": 0, "activations": 40, "other": 0},
     "spike": 20},
    {"event": "snapshot", "step": 1, "micro_step": 0, "phase": "step_end", "allocated": 110, "peak": 150,
     "reserved": 110, "live": {"weights": 60, "gradients": 10, "optimizer_states": 20, "activations": 20, "other": 0},
     "spike": 40},
    {"event": "step", "step": 1, "rank": 0, "peak": 150, "peak_phase": "step_end", "dominant": "weights"},
]


def test_report_names_malformed_records_and_draws_the_rest(tmp_path, capsys):
    lines = [json.dumps(r) for r in GOOD]
    lines += [json.dumps({**GOOD[3], "peak": "big"}), "[1, 2]", '"text"', "42", "{not json"]
    (tmp_path / "timeline.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["report", str(tmp_path / "timeline.jsonl"), "-o", str(tmp_path / "m.html")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "skipped 4 malformed records" in err[0] and "peak='big'" in err[0]
    assert (tmp_path / "m.html").stat().st_size > 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
fields = st.sampled_from(["peak", "allocated", "reserved", "live", "spike", "step", "phase", "micro_step",
                          "event", "stage", "detail", "peak_phase", "budget"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(index=st.integers(0, len(GOOD) - 1), field=fields, value=json_values, extra=json_values)
def test_report_never_tracebacks_on_any_timeline_line(tmp_path_factory, capsys, index, field, value, extra):
    folder = tmp_path_factory.mktemp("fuzz")
    broken = {**GOOD[index], field: value}
    lines = [json.dumps(r) for r in GOOD] + [json.dumps(broken), json.dumps(extra)]
    (folder / "timeline.jsonl").write_text("\n".join(lines) + "\n")
    status = main(["report", str(folder / "timeline.jsonl"), "-o", str(folder / "m.html")])
    err = capsys.readouterr().err
    assert status in (0, 2) and "Traceback" not in err and len(err.strip().splitlines()) <= 1
