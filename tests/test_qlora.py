"""QLoRA: a bitsandbytes-quantized base (bitsandbytes quantizes on the CPU) with LoRA adapters.

``hf-memwatch estimate MODEL --load-in-4bit ...`` against PyTorch's own accounting of a real QLoRA
``Trainer.train()`` (the base saved, loaded back through ``BitsAndBytesConfig``, prepared by
``prepare_model_for_kbit_training``, LoRA applied), its configuration errors, and the auto mode on
TRL's SFTTrainer with a 4-bit base: it plans, fits, and is the hand-configured run of its plan.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import hand_configured, read_records
from test_equivalence import FULL, assert_same_training, llama, sft_dataset

from hf_memwatch import MemWatch, estimate
from hf_memwatch.cli.main import main
from hf_memwatch.core.errors import MemWatchConfigError
from hf_memwatch.core.run_config import RunConfig
from hf_memwatch.estimation.peft import LoraSpec
from hf_memwatch.estimation.quantized import QuantSpec
from hf_memwatch.measure.attribution import weight_storages
from hf_memwatch.planning.catalogue import unavailable_remedies, with_state_share
from hf_memwatch.testing.estimate_truth import trainer_peak
from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # the optional CPU kernel package's notice
LORA = LoraSpec(r=8, alpha=16, targets="all-linear")


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    model = llama()
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return path


def load_quantized(path: Path, quant: QuantSpec) -> Any:
    """The base as a user loads it for QLoRA: through ``BitsAndBytesConfig``, then prepared."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant.bnb_config(), device_map="cpu")
    return prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)


def test_qlora_estimate_matches_the_profiler(llama_checkpoint: Path, capsys: Any) -> None:
    """4-bit nf4 with double quantization; 8-bit and the other 4-bit options: benchmarks/peft_accuracy.py."""
    from peft import get_peft_model

    quant = QuantSpec(bits=4, quant_type="nf4", double_quant=True)
    argv = ["estimate", str(llama_checkpoint), "--micro-batch-size", "2", "--seq-len", "16", "--precision", "bf16",
            "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "all-linear", "--json", "--load-in-4bit",
            "--double-quant", "--no-activation-checkpointing"]  # the base below is prepared without checkpointing
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["quantization"] == {"bits": 4, "quant_type": "nf4", "double_quant": True,
                                              "compute_dtype": "fp32"}

    base = load_quantized(llama_checkpoint, quant)
    # A built quantized base with a LoRA spec: the same estimate (its quantization state kept).
    assert estimate(base, micro_batch_size=2, seq_len=16, precision="bf16", lora=LORA).peak_bytes == data["peak_bytes"]
    model = get_peft_model(base, LORA.peft_config("causal-lm"))
    # The quantized weights as loaded: packed data, absmax (nested statistics), code tables, scales.
    assert data["classes"]["weights"] == sum(weight_storages(model, None).values())
    # ... of which the quantization state (neither a parameter nor a buffer): per 4-bit weight of n values
    # with double quantization, a uint8 absmax per 64 values, an fp32 per 256 blocks, its offset, the nf4
    # code (16 fp32) and the nested code table (256 fp32; each layer loads its own copy).
    plain = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in [*model.parameters(), *model.buffers()]}
    blocks = [math.ceil(p.quant_state.shape.numel() / 64) for p in model.parameters() if hasattr(p, "quant_state")]
    assert len(blocks) == 14  # 7 linears in each of 2 layers; the LM head stays unquantized
    assert data["classes"]["weights"] - sum(plain.values()) == sum(
        b + 4 * math.ceil(b / 256) + 4 + 16 * 4 + 256 * 4 for b in blocks)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert data["trainable_params"] == trainable
    assert data["details"]["weights"]["trainable"] == 4 * trainable
    assert data["details"]["weights"]["frozen"] == data["classes"]["weights"] - 4 * trainable
    truth = trainer_peak(model, task="causal-lm", micro_batch_size=2, seq_len=16, precision="bf16")
    assert abs(data["peak_bytes"] - truth) <= 0.005 * truth, (data["peak_bytes"], truth)


def test_the_cli_quantized_path_checkpoints_as_prepare_model_for_kbit_training(llama_checkpoint: Path,
                                                                               capsys: Any) -> None:
    """Without --activation-checkpointing/--no-activation-checkpointing, ``--load-in-4bit`` estimates the base as PEFT prepares
    it by default (checkpointing on), against the profiler's peak of that run."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    argv = ["estimate", str(llama_checkpoint), "--micro-batch-size", "2", "--seq-len", "64", "--precision", "bf16",
            "--lora-r", "8", "--lora-alpha", "16", "--lora-targets", "all-linear", "--json", "--load-in-4bit"]
    peaks = {}
    for extra in ([], ["--activation-checkpointing"], ["--no-activation-checkpointing"]):
        assert main([*argv, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        peaks[" ".join(extra)] = data["peak_bytes"]
        assert data["config"]["activation_checkpointing"] is (extra != ["--no-activation-checkpointing"])
    assert peaks[""] == peaks["--activation-checkpointing"] < peaks["--no-activation-checkpointing"]
    quant = QuantSpec(bits=4)
    base = AutoModelForCausalLM.from_pretrained(llama_checkpoint, quantization_config=quant.bnb_config(),
                                                device_map="cpu")
    model = get_peft_model(prepare_model_for_kbit_training(base), LORA.peft_config("causal-lm"))
    truth = trainer_peak(model, task="causal-lm", micro_batch_size=2, seq_len=64, precision="bf16")
    assert 0.99 * truth <= peaks[""] <= 1.03 * truth, (peaks, truth)


@pytest.mark.parametrize(("flags", "message"), [
    (["--double-quant"], "need --load-in-4bit"),
    (["--bnb-4bit-quant-type", "fp4", "--load-in-8bit"], "need --load-in-4bit"),
    (["--load-in-4bit"], "add --lora-r 16 --lora-targets all-linear"),  # a quantized base trains adapters only
])
def test_bad_quantization_flags_are_one_line(llama_checkpoint: Path, capsys: Any, flags: list[str],
                                             message: str) -> None:
    assert main(["estimate", str(llama_checkpoint), "--micro-batch-size", "2", "--seq-len", "16", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_quantization_without_bitsandbytes_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what an environment without it imports
    with pytest.raises(MemWatchConfigError, match=r"load_in_4bit needs bitsandbytes, which is not installed \(pip install 'hf-memwatch\[bnb\]'\)"):
        QuantSpec(bits=4)


def test_quantization_of_a_built_model_is_refused() -> None:
    with pytest.raises(MemWatchConfigError, match="a built model is estimated as it was loaded"):
        estimate(llama(), micro_batch_size=2, seq_len=16, lora=LORA, quantization=QuantSpec(bits=4))


def sft_qlora(out: Path, base: Any, callbacks: list[Any], **overrides: Any) -> Any:
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    values = dict(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, max_length=64, disable_tqdm=True, dataloader_num_workers=0,
                  seed=0)
    values.update(overrides)
    return SFTTrainer(model=base, args=SFTConfig(**values), train_dataset=sft_dataset(rows=4, length=32),
                      processing_class=word_tokenizer(), callbacks=callbacks,
                      peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))


def test_auto_mode_on_sft_qlora_fits_and_is_the_hand_configured_run(llama_checkpoint: Path, tmp_path: Path) -> None:
    quant = QuantSpec(bits=4, quant_type="nf4")
    probe = sft_qlora(tmp_path / "probe", load_quantized(llama_checkpoint, quant), [])
    given = estimate(probe)
    # LoRA: the optimizer states are a rounding error, so 8-bit AdamW is not a remedy here.
    why = unavailable_remedies(with_state_share(RunConfig.from_trainer(probe), given))["8-bit AdamW"]
    assert "would save almost nothing" in why
    budget = int(0.85 * given.peak_bytes)
    del probe

    torch.manual_seed(0)
    # Every step fully tracked: the dispatch mode must not change bitsandbytes' kernels under autocast.
    auto = sft_qlora(tmp_path / "auto", load_quantized(llama_checkpoint, quant),
                     [MemWatch(auto=True, budget=budget, **FULL)])
    resident = sum(weight_storages(auto.model, None).values())
    with cpu_memory_profile() as prof:
        auto.train()
    assert window_peak(prof, resident) <= budget
    [plan] = [r for r in read_records(tmp_path / "auto") if r["event"] == "plan"]
    assert (plan["micro_batch_size"], plan["activation_checkpointing"]) != (2, False)  # a plan was needed
    assert "8bit" not in plan["optim"]

    torch.manual_seed(0)
    hand = sft_qlora(tmp_path / "hand", load_quantized(llama_checkpoint, quant), [], **hand_configured(plan))
    hand.train()
    assert_same_training(auto, hand, steps=2)


def test_oom_post_mortem_estimates_what_is_trained_and_skips_8bit_adamw(llama_checkpoint: Path) -> None:
    """A (Q)LoRA run's post-mortem estimates the PEFT model, not a full fine-tune of its config: its
    optimizer states are a rounding error, so 8-bit AdamW is not among the remedies."""
    from peft import get_peft_model

    from hf_memwatch.reporting.oom import estimate_remedies

    adapters = LoraSpec(r=2, targets=("q_proj", "v_proj"))  # 896 adapter parameters: states ~0.5% of the peak
    model = get_peft_model(load_quantized(llama_checkpoint, QuantSpec(bits=4)), adapters.peft_config("causal-lm"))
    run = RunConfig(micro_batch_size=1, seq_len=16, precision="bf16", task="causal-lm")
    baseline, remedies, note = estimate_remedies(model, run)
    assert note == ""
    assert baseline == estimate(model, micro_batch_size=1, seq_len=16, precision="bf16").peak_bytes
    assert [name for name, peak, _ in remedies if peak is not None] == ["activation checkpointing on"]
