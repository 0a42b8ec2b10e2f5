"""``hf-memwatch estimate``: JSON output, the table with a budget, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import GPT2Config

from hf_memwatch.cli.main import main
from hf_memwatch.estimation.estimate import estimate


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    return path


def test_json_output_matches_the_python_api(model_dir, capsys):
    status = main(["estimate", str(model_dir), "--micro-batch-size", "2", "--seq-len", "32", "--json"])
    assert status == 0
    data = json.loads(capsys.readouterr().out)  # stdout holds the JSON object only
    expected = estimate(str(model_dir), micro_batch_size=2, seq_len=32)
    assert data["peak_bytes"] == expected.peak_bytes
    assert data["peak_phase"] == expected.peak_phase
    assert set(data["classes"]) == {"weights", "gradients", "optimizer_states", "activations", "temporaries", "other"}
    assert sum(data["classes"].values()) == data["peak_bytes"]
    assert data["params"] == data["trainable_params"] > 0
    assert data["fits"] is None
    assert data["config"]["task"] == "causal-lm"  # from the config's architectures
    # The logits are most of this step: the fused/chunked loss routes are advised with their bytes.
    logits = sum(part for named in data["details"].values() for name, part in named.items() if name.startswith("logits"))
    assert logits >= 0.05 * data["peak_bytes"]
    # a CPU target: no CUDA-only advice (Liger's Triton kernels); --device cuda adds it
    assert [a["name"].split(" ")[0] for a in data["advice"]] == ["trl.SFTTrainer"]
    assert all(a["saving"] == logits for a in data["advice"])


def test_budget_adds_fit_largest_batch_and_remedies(model_dir, capsys):
    config_json = model_dir / "config.json"
    tight = estimate(str(config_json), micro_batch_size=8, seq_len=32).peak_bytes - 1
    status = main(["estimate", str(config_json), "--micro-batch-size", "8", "--seq-len", "32", "--budget", str(tight),
                   "--json"])
    assert status == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] is False
    assert 1 <= data["largest_fitting_batch"] < 8
    remedies = {row["remedy"]: row for row in data["remedies"]}
    assert remedies["activation checkpointing"]["peak_bytes"] < remedies["as given"]["peak_bytes"]
    assert remedies["activation checkpointing"]["fits"] is True
    assert data["plan"]["micro_batch_size"] * data["plan"]["gradient_accumulation_steps"] == 8
    assert data["plan"]["predicted_peak"] <= tight


def test_table_output(model_dir, capsys):
    status = main(["estimate", str(model_dir), "--micro-batch-size", "2", "--seq-len", "32", "--budget", "1GiB"])
    assert status == 0
    out = capsys.readouterr().out
    for word in ("activations", "optimizer_states", "peak during the", "fits", "remedies", "largest micro-batch"):
        assert word in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["MISSING"], "no such file"),
        (["MODEL", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
        (["MODEL", "--seq-len", "-5"], "--seq-len must be at least 1"),
        (["MODEL", "--optim", "magic"], "unsupported optim 'magic'"),
        (["MODEL", "--budget", "12 parsecs"], "cannot parse --budget"),
        (["MODEL", "--budget", "0.8"], "give the size, e.g. --budget 24GiB"),
        (["MODEL", "--load-in-4bit"], "add --lora-r 16 --lora-targets all-linear"),
        (["MODEL", "--task", "vision"], "invalid choice"),
        (["MODEL", "--precision", "fp8"], "invalid choice"),
        (["BADJSON"], "cannot load a config"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(model_dir, tmp_path, capsys, argv, message):
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    replace = {"MODEL": str(model_dir), "MISSING": str(tmp_path / "nope" / "config.json"), "BADJSON": str(bad)}
    argv = [replace.get(a, a) for a in argv]
    with pytest.raises(SystemExit) if argv[1:2] and argv[1] in ("--task", "--precision") else _returns() as box:
        box.value = main(["estimate", *argv])
    status = box.value.code if isinstance(box.value, SystemExit) else box.value
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


class _returns:
    """Context that stores a return value in ``.value`` (the counterpart of ``pytest.raises``)."""

    value = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_console_script_exit_status_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hf_memwatch.cli", "estimate", str(tmp_path / "absent"), "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                vocab_size=128, bos_token_id=0, eos_token_id=0, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


def test_lora_flags_freeze_the_base_and_train_the_adapters(llama_dir, capsys):
    from hf_memwatch.estimation.peft import LoraSpec

    argv = ["estimate", str(llama_dir), "--micro-batch-size", "2", "--seq-len", "32", "--json", "--lora-r", "4",
            "--lora-targets", "q_proj,v_proj", "--lora-alpha", "8", "--lora-dropout", "0.1"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    # two adapted projections of 32 -> 32 (q) and 32 -> 16 (v), rank 4: A (4 x 32) + B (out x 4) each
    assert data["trainable_params"] == 4 * 32 + 32 * 4 + 4 * 32 + 16 * 4
    assert data["details"]["weights"] == {"frozen": data["classes"]["weights"] - 4 * data["trainable_params"],
                                          "trainable": 4 * data["trainable_params"]}
    spec = LoraSpec(r=4, alpha=8, targets=("q_proj", "v_proj"), dropout=0.1)
    assert data["peak_bytes"] == estimate(str(llama_dir), micro_batch_size=2, seq_len=32, lora=spec).peak_bytes
    full = estimate(str(llama_dir), micro_batch_size=2, seq_len=32)
    assert data["classes"]["optimizer_states"] < full.classes["optimizer_states"] / 10


def test_saved_adapter_folder_names_its_base(llama_dir, tmp_path, capsys):
    """A folder PEFT's save_pretrained wrote: as --adapter (base from its config or MODEL) or as MODEL."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llama_dir))  # name_or_path = llama_dir
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    assert not (adapter / "config.json").exists()
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(llama_dir)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    expected = estimate(peft_model, micro_batch_size=2, seq_len=32)  # the built PeftModel: the exact path

    for argv in (["--adapter", str(adapter)], [str(llama_dir), "--adapter", str(adapter)], [str(adapter)]):
        assert main(["estimate", *argv, "--micro-batch-size", "2", "--seq-len", "32", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["trainable_params"] == trainable
        assert data["peak_bytes"] == expected.peak_bytes


@pytest.mark.parametrize(("argv", "message"), [
    (["--lora-alpha", "16"], "need --lora-r"),
    (["--lora-r", "0"], "lora r must be a positive integer"),
    (["--lora-r", "4", "--lora-targets", "no_such_module"], "cannot apply the adapter"),
])
def test_bad_lora_flags_are_one_line(llama_dir, capsys, argv, message):
    assert main(["estimate", str(llama_dir), "--micro-batch-size", "2", "--seq-len", "32", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


BAD_BEFORE_IMPORTS = [
    (["estimate", "MODEL", "--budget", "0.8"], "--budget 0.8 is a fraction"),
    (["estimate", "MODEL", "--load-in-4bit"], "add --lora-r"),
    (["estimate", "MODEL", "--micro-batch-size", "0"], "--micro-batch-size must be at least 1"),
    (["estimate"], "give MODEL"),
    (["estimate", "MISSING", "--micro-batch-size", "2"], "no such file or directory"),
    (["report", "EMPTY"], "give the output_dir of a Trainer run with MemWatch()"),
    (["report", "EMPTY", "-o", "memory.pdf"], "-o must end in .png"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_BEFORE_IMPORTS)
def test_bad_arguments_answer_before_torch_is_imported(model_dir, tmp_path, argv, message):
    """The check runs before the heavy imports: the process that answers never imported torch."""
    (tmp_path / "empty").mkdir()
    argv = [{"MODEL": str(model_dir), "EMPTY": str(tmp_path / "empty"), "MISSING": str(tmp_path / "nope")}.get(a, a)
            for a in argv]
    code = ("import sys; from hf_memwatch.cli.main import main; status = main(sys.argv[1:]); "
            "print(status, 'torch' in sys.modules, 'transformers' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False", "False"]
    (line,) = proc.stderr.strip().splitlines()
    assert message in line


def test_version():
    proc = subprocess.run([sys.executable, "-m", "hf_memwatch.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    import hf_memwatch

    assert proc.returncode == 0 and proc.stdout.strip() == f"hf-memwatch {hf_memwatch.__version__}"


def test_unknown_model_type_names_the_close_ones(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "lama", "hidden_size": 8}')
    assert main(["estimate", str(config)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "model_type 'lama' is not one of the" in line and "did you mean llama" in line
    assert "hf_memwatch.estimate(model" in line


def test_cuda_only_advice_only_for_a_cuda_target(tmp_path, model_dir, capsys):
    # a 32k vocabulary: the logits stay a large share of a CUDA step's peak beside the cuBLAS workspaces
    big_vocab = tmp_path / "gpt2-32k"
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=32000, n_positions=64, bos_token_id=0, eos_token_id=0,
               architectures=["GPT2LMHeadModel"]).save_pretrained(big_vocab)
    assert main(["estimate", str(big_vocab), "--micro-batch-size", "2", "--seq-len", "32", "--device", "cuda", "--json"]) == 0
    names = [a["name"].split(" ")[0] for a in json.loads(capsys.readouterr().out)["advice"]]
    assert names == ["use_liger_kernel=True", "trl.SFTTrainer"]
