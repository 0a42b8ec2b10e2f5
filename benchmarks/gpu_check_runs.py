"""Models, datasets, ``Trainer`` runs and the callbacks that read the device, for ``benchmarks/gpu_check.py``."""

from __future__ import annotations

import gc
import tempfile
import time
from typing import Any

import torch
import transformers
from gpu_check_probe import Probe
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_memwatch import MemWatch
from hf_memwatch.integration.compiled import hook_target


# -- models and runs ----------------------------------------------------------------------------
def model_config(arch: str, tiny: bool = False) -> Any:
    """The ``PretrainedConfig`` of ``arch`` (SDPA attention); ``tiny`` for the dry run."""
    if arch in ("llama-1b", "qwen3-1.7b") and tiny:
        cls = transformers.Qwen3Config if arch.startswith("qwen") else transformers.LlamaConfig
        config = cls(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     tie_word_embeddings=True)
    elif arch == "llama-1b":  # Llama-3.2-1B's shape: 1.24 B parameters
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                          head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                                          tie_word_embeddings=True)
    elif arch == "qwen3-1.7b":  # Qwen3-1.7B's shape: 1.72 B parameters
        config = transformers.Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True)
    elif arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2 if tiny else 12, n_embd=64 if tiny else 768,
                                         n_head=4 if tiny else 12, vocab_size=1000 if tiny else 50257,
                                         n_positions=1024)
    elif arch == "bert":
        hidden = 64 if tiny else 768
        config = transformers.BertConfig(vocab_size=1000 if tiny else 30522, hidden_size=hidden,
                                         num_hidden_layers=2 if tiny else 12, num_attention_heads=4 if tiny else 12,
                                         intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=2)
    elif arch == "llama":
        config = transformers.LlamaConfig(vocab_size=1000 if tiny else 32000, hidden_size=64 if tiny else 1024,
                                          intermediate_size=172 if tiny else 2816, num_hidden_layers=2 if tiny else 8,
                                          num_attention_heads=4 if tiny else 16, num_key_value_heads=2 if tiny else 8,
                                          max_position_embeddings=2048)
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    config._attn_implementation = "sdpa"
    return config


def task_of(arch: str) -> str:
    return "seq-cls" if arch == "bert" else "causal-lm"


def build_model(arch: str, tiny: bool = False, device: Any = "cpu") -> Any:
    """A model of ``arch`` from its config with random weights, initialised on ``device`` (fast on a GPU)."""
    torch.manual_seed(0)
    config = model_config(arch, tiny)
    auto = (transformers.AutoModelForSequenceClassification if task_of(arch) == "seq-cls"
            else transformers.AutoModelForCausalLM)
    with torch.device(device):
        return auto.from_config(config)


def build_qlora_model(arch: str, tiny: bool, device: Any, workdir: str) -> tuple[Any, Any, Any]:
    """QLoRA as users build it: base saved, loaded 4-bit (nf4, bf16 compute), prepared, LoRA r=16 on all linears.

    Returns the model and the (quantization, lora) specs the estimate takes.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    from hf_memwatch.estimation.peft import LoraSpec
    from hf_memwatch.estimation.quantized import QuantSpec

    quant = QuantSpec(bits=4, quant_type="nf4", compute_dtype="bf16")
    lora = LoraSpec(r=16, alpha=32, targets="all-linear")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        build_model(arch, tiny, device).to(torch.bfloat16).save_pretrained(tmp)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=quant.bnb_config(), device_map={"": str(device)}, attn_implementation="sdpa")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    return get_peft_model(base, lora.peft_config("causal-lm")), quant, lora


class TokenDataset:
    """Random token sequences: LM labels copy the inputs, classification draws a class."""

    def __init__(self, n: int, seq_len: int, vocab: int, classification: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen) if classification else self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def dataset_for(model: Any, batch: int, seq_len: int, steps: int) -> TokenDataset:
    classification = type(model).__name__.endswith("ForSequenceClassification")
    return TokenDataset(batch * steps, seq_len, model.config.vocab_size, classification)


def training_args(output_dir: str, *, batch: int, steps: int, device: str, **overrides: Any) -> Any:
    """``TrainingArguments`` of every run here: no saving, no reporting, quiet."""
    values: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, logging_steps=10_000,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=device == "cpu",
    )
    checkpointing = overrides.pop("checkpointing", False)
    fields = TrainingArguments.__dataclass_fields__
    values["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = checkpointing
    values.update(overrides)
    return TrainingArguments(**values)


class StepClock(TrainerCallback):
    """Steady-state seconds per step: the time from step ``warmup``'s end to the last step's end.

    Synchronizes the device only at those two instants, so the steps in between run as in
    production (asynchronously) and per-step host costs show only where they cost time.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.warmup:
            self.start = self._now()
        elif state.global_step > self.warmup:
            self.end = self._now()
            self.steps = state.global_step - self.warmup

    def seconds_per_step(self) -> float:
        if self.start is None or self.end is None or self.steps < 1:
            raise RuntimeError("the run was shorter than the warm-up")
        return (self.end - self.start) / self.steps


def timed_run(arch: str, *, batch: int, seq_len: int, steps: int, warmup: int, device: str,
              memwatch: bool, tiny: bool = False, workdir: str | None = None) -> float:
    """Seconds per steady-state step of one Trainer run, with or without ``MemWatch(report=False)``.

    ``report=False``: the picture is drawn by a background process at train end, which would run
    during the next timed run.
    """
    model = build_model(arch, tiny=tiny)
    clock = StepClock(warmup)
    callbacks = [clock] + ([MemWatch(report=False)] if memwatch else [])
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        args = training_args(tmp, batch=batch, steps=steps, device=device, bf16=device == "cuda")
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, steps),
                          callbacks=callbacks)
        trainer.train()
        seconds = clock.seconds_per_step()
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds


# -- callbacks reading the device -----------------------------------------------------------------
class PeakWindow(TrainerCallback):
    """Resets the device's peak at every step begin and reads it at step end: placed first in both the
    MemWatch run and its twin, so both measure the same windows."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.peaks: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.probe.reset_peak()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.peaks.append(self.probe.peak())


class AllocatorReader(TrainerCallback):
    """Reads the device's allocated bytes and peak at MemWatch's instants, just before it.

    Placed before ``MemWatch`` in the callback list, it hooks the module MemWatch hooks
    (:func:`~hf_memwatch.integration.compiled.hook_target`), registered first, so its reading comes
    first and its peak covers the same window MemWatch's snapshot does. Where MemWatch does not reset
    this peak counter itself (the CPU probe), the reader resets it after each reading.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.trainer: Any = None
        self.reads: list[dict[str, Any]] = []
        self.step = 0
        self.in_step = False
        self.hooked: str | None = None

    def _read(self, phase: str) -> None:
        self.probe.synchronize()
        self.reads.append({"step": self.step, "phase": phase, "allocated": self.probe.allocated(),
                           "peak": self.probe.peak()})
        if not self.probe.shares_memwatch_peak:
            self.probe.reset_peak()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        target = hook_target(model, getattr(self.trainer, "model_wrapped", None))
        self.hooked = type(target).__name__
        target.register_forward_hook(self._after_forward)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.in_step and torch.is_grad_enabled():
            self._read("after_forward")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step, self.in_step = state.global_step + 1, True
        self._read("step_begin")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("step_end")
        self.in_step = False


class PeakFromTrainBegin(TrainerCallback):
    """Resets the device's peaks once the model is placed and the optimizer built."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.probe.reset_peak()


def train(probe: Probe, model: Any, args: Any, dataset: Any, callbacks: list[Any]) -> Any:
    """One ``Trainer`` run inside the probe's session; the trainer."""
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    for callback in callbacks:
        if isinstance(callback, AllocatorReader):
            callback.trainer = trainer
    with probe.session(model, dataset):
        trainer.train()
    probe.synchronize()
    return trainer
