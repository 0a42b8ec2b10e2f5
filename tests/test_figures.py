"""One estimate, one set of figures (hf_memwatch/cli/figures.py): over every output of several real
estimates — the table, the plan line, the remedies, ``--top`` and ``--json`` — the figures are the same
numbers, each named with what it is; on a CUDA target the reserve and the device total are in the table;
the phase reads as the stage; the weights' dtype and its source are printed, and ``--weights-dtype``
overrides the config's.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from transformers import GPT2Config, LlamaConfig

from hf_memwatch.cli.estimate import _print_table as print_table
from hf_memwatch.cli.main import main
from hf_memwatch.core.categories import phase_words
from hf_memwatch.core.units import format_bytes
from hf_memwatch.planning.predict import ESTIMATE_MARGIN


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("figures")
    GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(base / "gpt2")
    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                        architectures=["LlamaForCausalLM"])
    llama.dtype = "bfloat16"  # saved as the config's torch_dtype, as a Hub checkpoint's
    llama.save_pretrained(base / "llama")
    return base


def outputs(argv: list[str], capsys, monkeypatch) -> tuple[dict, str]:
    """(the --json object, the table the command prints for that object — its text with the box drawing
    and whitespace runs made one space) of one estimate, made once."""
    monkeypatch.setenv("COLUMNS", "300")  # one table row on one line
    assert main(["estimate", *argv, "--json"]) in (0, 1)
    payload = json.loads(capsys.readouterr().out)
    print_table(payload)
    return payload, re.sub(r"[\s│┃┏┳┓┡╇┩└┴┘━─]+", " ", capsys.readouterr().out)


CASES = [
    ["gpt2", "--micro-batch-size", "4", "--seq-len", "32", "--budget", "8MiB", "--top", "5"],
    ["gpt2", "--micro-batch-size", "4", "--seq-len", "32", "--budget", "1GiB"],
    ["llama", "--micro-batch-size", "2", "--seq-len", "48", "--budget", "2MiB", "--device", "cuda", "--top", "3"],
    ["llama", "--micro-batch-size", "2", "--seq-len", "48", "--precision", "bf16", "--budget", "64MiB"],
]


@pytest.mark.parametrize("argv", CASES, ids=["gpt2-tight-top", "gpt2-ample", "llama-cuda-top", "llama-bf16"])
def test_every_output_reads_the_same_figures(models, capsys, monkeypatch, argv):
    argv = [str(models / argv[0]), *argv[1:]]
    payload, table = outputs(argv, capsys, monkeypatch)
    peak = payload["peak_bytes"]
    # the table: each class and the peak, in bytes and in units
    assert sum(payload["classes"].values()) == peak
    assert f"peak {peak:,} {format_bytes(peak)} 100%" in table
    assert f"peak {phase_words(payload['peak_phase'])}" in table
    # the remedies: the first is the configuration as given, at the table's peak; every planned figure is
    # the row's peak plus the planning margin; each saving is against the table's peak
    rows = payload["remedies"]
    assert rows[0]["remedy"] == "as given" and rows[0]["peak_bytes"] == peak
    for row in rows:
        assert row["predicted_peak"] == math.ceil(row["peak_bytes"] * (1 + ESTIMATE_MARGIN))
        assert row["fits"] == (row["predicted_peak"] <= payload["budget"])
        saves = "-" if row is rows[0] else format_bytes(peak - row["peak_bytes"])
        assert (f"{row['remedy']} {format_bytes(row['peak_bytes'])} {saves} {format_bytes(row['predicted_peak'])} "
                f"{'yes' if row['fits'] else 'no'} {row['largest_fitting_batch']}") in table
        if row.get("removes"):
            assert f"{row['remedy']}: saves {format_bytes(peak - row['peak_bytes'])} ({format_bytes(peak)} ->" in table
    # the verdict: --json's fits, the budget line and the plan compare the same figure
    assert payload["fits"] == rows[0]["fits"]
    assert f"{'fits' if payload['fits'] else 'does not fit'} (planned {format_bytes(rows[0]['predicted_peak'])}" in table
    plan = payload["plan"]
    if plan is not None:
        same = [r for r in rows if (r["activation_checkpointing"], r["optim"]) == (plan["activation_checkpointing"], plan["optim"])]
        if plan["micro_batch_size"] == int(argv[argv.index("--micro-batch-size") + 1]):
            assert plan["predicted_peak"] == same[0]["predicted_peak"]
        assert f"predicted peak {format_bytes(plan['predicted_peak'])}" in table
    # --top: the tensors' peak is the table's, or the line says whose it is
    record = payload.get("peak_tensors")
    if record is not None:
        assert record["peak"] == peak or "the tensors below are those of the simulation of fewer layers" in table
        assert f": {format_bytes(record['peak'])} in {record['count']} storages" in table


def test_a_cuda_target_shows_allocated_reserved_and_device_total(models, capsys, monkeypatch):
    payload, table = outputs([str(models / "llama"), "--micro-batch-size", "2", "--seq-len", "48", "--device", "cuda"],
                             capsys, monkeypatch)
    reserved = payload["reserved_bytes"]
    assert reserved >= payload["peak_bytes"]
    assert f"reserved (caching allocator) {reserved:,} {format_bytes(reserved)}" in table
    device = payload["device_bytes"]  # reserved + the published context for the assumed card (cuda_device.py)
    assert device > reserved and f"device total {device:,} {format_bytes(device)}" in table
    assert "max_memory_reserved: the figure an out-of-memory is decided on" in table
    cpu, cpu_table = outputs([str(models / "llama"), "--micro-batch-size", "2", "--seq-len", "48"], capsys, monkeypatch)
    assert "reserved" not in cpu_table and "device total" not in cpu_table  # the CPU target's table as before


def test_the_weights_dtype_is_printed_with_its_source_and_overridden(models, capsys, monkeypatch):
    argv = [str(models / "llama"), "--micro-batch-size", "2", "--seq-len", "48"]
    config, table = outputs(argv, capsys, monkeypatch)
    assert config["weights"] == {"dtype": "bf16",
                                 "source": "the config's torch_dtype, as from_pretrained loads the weights by default"}
    assert "weights bf16 (the config's torch_dtype" in table and "--weights-dtype fp32" in table
    fp32, table = outputs([*argv, "--weights-dtype", "fp32"], capsys, monkeypatch)
    assert fp32["weights"] == {"dtype": "fp32", "source": "--weights-dtype"}
    # 4 bytes a parameter instead of 2 (the buffers, rotary's inv_freq, stay fp32 in both)
    assert fp32["classes"]["weights"] - config["classes"]["weights"] == 2 * config["params"]
    gpt2, table = outputs([str(models / "gpt2"), "--micro-batch-size", "2", "--seq-len", "32"], capsys, monkeypatch)
    assert gpt2["weights"]["dtype"] == "fp32" and "weights fp32" in table
