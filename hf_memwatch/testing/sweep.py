"""A seeded sweep of training configurations, each measured against PyTorch's profiler.

:func:`draw` turns a seed into a :class:`Draw`: an architecture family (:mod:`.families`), its depth
and (Llama-like families) width, the micro-batch and sequence length, the batches' shape (fixed,
ragged and padded, padding-free), precision (fp32, bf16 autocast), the optimizer — by name
(``TrainingArguments.optim``) or as an instance handed to the Trainer (``optimizers=(opt, None)``:
torch's SGD / SGD momentum / AdamW ``foreach=False``, bitsandbytes' ``Adam8bit``) —, activation
checkpointing (off, non-reentrant, reentrant), gradient accumulation and LoRA (PEFT) on Llama-like
families. :func:`run_draw` builds that Trainer and measures, with :func:`~.perturbation.compare`:

* ``estimate(trainer)`` against the profiler's peak of the run without MemWatch;
* MemWatch's live step peaks against the profiler's step peaks of the watched run;
* with ``auto=True`` (every third draw in ``benchmarks/sweep.py``), ``MemWatch(auto=True)`` at a budget
  of 0.7 x the unwatched peak: its profiler peak must be under the budget, or the run stopped with
  "no plan fits" — then the most conservative plan (micro-batch 1, the effective batch by
  accumulation, checkpointing where the model allows it), configured by hand, is measured: over the
  budget, the stop was truthful.

:func:`variants` adds the draw kinds the seeded space does not produce, on fixed configurations:
weights loaded in bf16/fp16, Adafactor and ``PagedAdamW8bit`` instances, QLoRA (nf4), and TRL's SFT
(map and iterable dataset), DPO and GKD (``lmbda`` 0 / 0.5 / 1: :class:`TrlDraw`), measured alike
(without the auto mode).

Everything runs on the CPU, 2 optimizer steps a run (truth: :mod:`.truth`).

Usage:
    >>> d = draw(7)                       # doctest: +SKIP
    >>> result = run_draw(d, auto=True)   # doctest: +SKIP
    >>> result.estimate_error, result.live_error, result.auto   # doctest: +SKIP
"""

from __future__ import annotations

import random
import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from .estimate_truth import ListDataset, _fresh_bitsandbytes_overrides
from .families import FAMILIES, NO_CHECKPOINTING
from .perturbation import _args, _baseline, compare
from .truth import cpu_memory_profile, window_peak

LLAMA_LIKE_FAMILIES = frozenset({"phi3", "gemma", "gemma2", "gemma3_text", "stablelm", "mistral", "qwen2", "olmo",
                                 "olmo2", "starcoder2"})
PADDING_FREE_FAMILIES = frozenset({"mistral", "qwen2", "olmo", "olmo2", "phi3", "starcoder2"})
OPTIM_NAMES = ("adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adamw_bnb_8bit", "rmsprop", "adagrad")
OPTIM_INSTANCES = ("SGD", "SGD(momentum=0.9)", "AdamW(foreach=False)", "bnb.Adam8bit")
DEPTH_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
AUTO_SHARE = 0.7


@dataclass(frozen=True)
class Draw:
    """One configuration of the sweep (see the module doc)."""

    seed: int
    family: str
    layers: int
    hidden: int | None  # None: the family's tiny default (64)
    batch: int
    seq_len: int
    shape: str  # "fixed" | "padded" (ragged lengths, padded per batch) | "padding-free"
    precision: str  # "fp32" | "bf16"
    optim: str  # a TrainingArguments.optim name, or "instance:<one of OPTIM_INSTANCES>"
    checkpointing: str  # "off" | "on" | "reentrant"
    accum: int
    lora: bool
    weights: str = "fp32"  # the weights' dtype as loaded: "fp32" | "bf16" | "fp16" | "nf4" (QLoRA: 4-bit + LoRA)

    def describe(self) -> str:
        parts = [f"{self.family} L{self.layers}" + (f" h{self.hidden}" if self.hidden else ""),
                 f"{self.batch}x{self.seq_len} {self.shape}", self.precision, self.optim,
                 f"ckpt {self.checkpointing}", f"accum {self.accum}"]
        if self.weights != "fp32":
            parts.append("QLoRA nf4" if self.weights == "nf4" else f"{self.weights} weights")
        return ", ".join(parts + (["LoRA"] if self.lora and self.weights != "nf4" else []))


def draw(seed: int) -> Draw:
    """The configuration of ``seed`` (the same on every machine)."""
    rng = random.Random(seed)
    family = rng.choice(sorted(FAMILIES))
    task = FAMILIES[family][0]
    llama_like = family in LLAMA_LIKE_FAMILIES
    shapes = ["fixed"] + (["padded"] if task != "seq-cls" else []) + (["padding-free"] if family in PADDING_FREE_FAMILIES else [])
    optim = rng.choice([*OPTIM_NAMES, *(f"instance:{name}" for name in OPTIM_INSTANCES)])
    checkpointing = "off" if family in NO_CHECKPOINTING else rng.choice(["off", "off", "on", "reentrant"])
    return Draw(seed=seed, family=family, layers=rng.choice([1, 2, 3]),
                hidden=rng.choice([None, 128]) if llama_like else None, batch=rng.choice([1, 2, 4]),
                seq_len=rng.choice([16, 32, 64, 128]), shape=rng.choice(shapes), precision=rng.choice(["fp32", "bf16"]),
                optim=optim, checkpointing=checkpointing, accum=rng.choice([1, 1, 2]),
                lora=llama_like and task == "causal-lm" and rng.random() < 0.2)


# -- the Trainer of a draw ----------------------------------------------------------------------------
def _model(d: Draw) -> Any:
    from ..estimation.fake_model import auto_class

    task, make_config = FAMILIES[d.family]
    config = make_config()
    for name in DEPTH_NAMES:
        if hasattr(config, name) and isinstance(getattr(config, name), int):
            setattr(config, name, d.layers)
            break
    if d.family == "gpt_neo":
        config.attention_types = [[["global"], d.layers]]
        config.attention_layers = ["global"] * d.layers
    types = getattr(config, "layer_types", None)
    if types:  # the family's pattern (sliding / full attention), cycled to the depth
        config.layer_types = [types[i % len(types)] for i in range(d.layers)]
    if d.hidden is not None:
        config.hidden_size, config.intermediate_size = d.hidden, 2 * d.hidden
    torch.manual_seed(0)
    model = auto_class(task).from_config(config)
    if d.weights == "nf4":
        model = _loaded_4bit(model)
    elif d.weights != "fp32":
        model = model.to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[d.weights]))
    if d.lora or d.weights == "nf4":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    return model


def _loaded_4bit(model: Any) -> Any:
    """``model`` saved and loaded back 4-bit (nf4) as ``BitsAndBytesConfig`` loads it (QLoRA's base)."""
    import transformers

    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")


def _lengths(d: Draw, gen: torch.Generator) -> list[int]:
    """Each row's length, in the order the sequential sampler feeds them (2 steps of ``batch x accum``).

    Ragged draws: the first step's rows are of random lengths in (seq_len/2, seq_len]; every
    micro-batch of the second (optimizer states resident), and the one accelerate fetches ahead during it,
    is the worst batch the estimator replays —
    ``batch`` rows of ``seq_len``, one of them the shortest (seq_len/2) where a padded batch has several
    (its padding mask materialised), so the run reaches the worst case the estimate is of.
    """
    step = d.batch * d.accum
    if d.shape == "fixed":
        return [d.seq_len] * 2 * step
    first = [int(n) for n in torch.randint(d.seq_len // 2 + 1, d.seq_len + 1, (step,), generator=gen)]
    worst = [d.seq_len] * d.batch
    if d.shape == "padded" and d.batch > 1:
        worst[-1] = d.seq_len // 2
    return first + worst * (d.accum + 1)  # + the micro-batch accelerate fetches ahead during the last step


def _rows(d: Draw) -> list[dict[str, Any]]:
    task = FAMILIES[d.family][0]
    gen = torch.Generator().manual_seed(d.seed)
    items = []
    for length in _lengths(d, gen):
        ids = torch.randint(1, 1000, (length,), generator=gen)
        if task == "seq-cls":
            items.append({"input_ids": ids, "labels": torch.tensor(int(ids[0]) % 2)})
        elif d.shape == "padding-free":
            items.append({"input_ids": ids.tolist(), "labels": ids.tolist()})
        else:
            items.append({"input_ids": ids, "labels": ids.clone()})
    return items


def pad_collator(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Pads a batch to its longest sample: pad id 0, attention mask 0, labels -100 (what a tokenizer's
    padding collator forms for causal and masked LMs)."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = item["input_ids"], 1, item["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _optimizer(d: Draw, model: Any) -> Any:
    if not d.optim.startswith("instance:"):
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    name = d.optim.removeprefix("instance:")
    if name == "SGD":
        return torch.optim.SGD(params, lr=0.01)
    if name == "SGD(momentum=0.9)":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    if name == "AdamW(foreach=False)":
        return torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if name == "Adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=1e-3, relative_step=False, scale_parameter=False)
    import bitsandbytes as bnb

    if name == "bnb.PagedAdamW8bit":
        return bnb.optim.PagedAdamW8bit(params, lr=1e-4)
    return bnb.optim.Adam8bit(params, lr=1e-4)


def builder(d: Draw, **overrides: Any) -> Any:
    """``build(output_dir, callbacks)``: the draw's Trainer, fresh (same seed, same data) each call;
    ``overrides``: training arguments set otherwise (a hand-configured plan's)."""

    def build(out: str, callbacks: list[Any]) -> Any:
        from transformers import DataCollatorWithFlattening, Trainer

        model = _model(d)
        extra: dict[str, Any] = dict(
            per_device_train_batch_size=d.batch, gradient_accumulation_steps=d.accum, bf16=d.precision == "bf16",
            activation_checkpointing=d.checkpointing != "off")
        if d.checkpointing == "reentrant":
            extra["activation_checkpointing_kwargs"] = {"use_reentrant": True}
        if not d.optim.startswith("instance:"):
            extra["optim"] = d.optim
        if d.shape != "fixed":
            extra["train_sampling_strategy"] = "sequential"  # the rows in _lengths' order
        extra.update(overrides)
        data = ListDataset(_rows(d))
        collator = {"fixed": None, "padded": pad_collator,
                    "padding-free": DataCollatorWithFlattening(return_position_ids=True)}[d.shape]
        _fresh_bitsandbytes_overrides()
        return Trainer(model=model, args=_args(out, **extra), train_dataset=data, data_collator=collator,
                       callbacks=callbacks, optimizers=(_optimizer(d, model), None))

    return build


# -- the variants: draw kinds outside the seeded space -------------------------------------------------
@dataclass(frozen=True)
class TrlDraw:
    """A TRL trainer on a tiny Llama (vocab of :func:`~.tokenizers.word_tokenizer`), 2 steps of 4 rows:
    ``sft`` (a map dataset of token ids), ``sft-iterable`` (rows streamed: ``IterableDataset``, each of ``max_length``
    tokens — a stream is estimated at the longest the run can feed, never read, so its truth is a stream
    that feeds that),
    ``dpo`` (a reference model), ``gkd`` (a teacher; on-policy generation of 8 tokens drawn per step
    with probability ``lmbda``)."""

    seed: int
    trainer: str
    precision: str = "fp32"
    lmbda: float | None = None

    def describe(self) -> str:
        lmbda = "" if self.lmbda is None else f" lmbda {self.lmbda}"
        return f"TRL {self.trainer}{lmbda}, llama L2, 4 rows, {self.precision}"


def _llama(seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1002, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001))


def trl_builder(v: TrlDraw) -> Any:
    """``build(output_dir, callbacks)``: the TRL variant's Trainer, fresh each call."""

    def build(out: str, callbacks: list[Any]) -> Any:
        from datasets import Dataset

        from .tokenizers import word_tokenizer

        gen = torch.Generator().manual_seed(v.seed)

        def words(n: int) -> str:
            return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=gen))

        common = dict(bf16=v.precision == "bf16", max_length=64, activation_checkpointing=False)
        tokenizer = word_tokenizer()
        if v.trainer.startswith("sft"):
            from trl import SFTConfig, SFTTrainer

            length = common["max_length"] if v.trainer == "sft-iterable" else 48
            data = Dataset.from_list([{"input_ids": torch.randint(0, 1000, (length,), generator=gen).tolist()}
                                      for _ in range(16)])
            if v.trainer == "sft-iterable":
                data = data.to_iterable_dataset()
            return SFTTrainer(model=_llama(), args=_args(out, SFTConfig, **common), train_dataset=data,
                              processing_class=tokenizer, callbacks=callbacks)
        if v.trainer == "dpo":
            from trl import DPOConfig, DPOTrainer

            data = Dataset.from_list([{"prompt": words(20), "chosen": words(20), "rejected": words(20)}
                                      for _ in range(16)])
            return DPOTrainer(model=_llama(), ref_model=_llama(1), args=_args(out, DPOConfig, **common),
                              train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
        data = Dataset.from_list([{"messages": [{"role": "user", "content": words(12)},
                                                {"role": "assistant", "content": words(4)}]} for _ in range(16)])
        return GKDTrainer(model=_llama(), teacher_model=_llama(1), train_dataset=data, processing_class=tokenizer,
                          args=_args(out, GKDConfig, max_new_tokens=8, lmbda=v.lmbda, **common), callbacks=callbacks)

    return build


def variants() -> list[Draw | TrlDraw]:
    """The draw kinds the seeded space does not produce (issue 37's list), each on fixed configurations:
    weights loaded in bf16 / fp16 (trained in that dtype), Adafactor and bitsandbytes' ``PagedAdamW8bit``
    handed in as instances, QLoRA (nf4 base + LoRA), and TRL's SFT (map and iterable dataset), DPO and GKD
    at ``lmbda`` 0, 0.5 and 1."""
    base = [draw(seed) for seed in range(40)]
    causal = [d for d in base if d.family in LLAMA_LIKE_FAMILIES and FAMILIES[d.family][0] == "causal-lm"]
    kinds: list[Draw | TrlDraw] = [replace(d, weights="bf16", precision="fp32") for d in base[0:4]]
    kinds += [replace(d, weights="fp16", precision="fp32") for d in base[4:8]]
    kinds += [replace(d, optim="instance:Adafactor") for d in base[8:11]]
    kinds += [replace(d, optim="instance:bnb.PagedAdamW8bit") for d in base[11:14]]
    kinds += [replace(d, weights="nf4", lora=True) for d in causal[:3]]
    kinds += [TrlDraw(1000, trainer, precision) for trainer in ("sft", "sft-iterable", "dpo")
              for precision in ("fp32", "bf16")]
    kinds += [TrlDraw(1000, "gkd", "fp32", lmbda) for lmbda in (0.0, 0.5, 1.0)]
    return kinds


# -- measuring a draw ---------------------------------------------------------------------------------
@dataclass
class DrawResult:
    """What one draw measured (bytes; errors relative to the profiler's figure)."""

    draw: Draw | TrlDraw
    truth: int | None = None  # the profiler's peak of the run without MemWatch
    estimate: int | None = None
    live: list[int] | None = None  # MemWatch's step peaks
    live_truth: list[int] | None = None  # the profiler's step peaks of the watched run
    auto: str | None = None  # "fits" | "no plan fits (truthful)" | "OVER BUDGET" | "no plan fits (UNTRUTHFUL)"
    auto_peak: int | None = None
    budget: int | None = None
    error: str | None = None  # the draw could not run (the configuration, not the measurement)
    branches: dict[str, int] | None = None  # the estimate's branches by name (MemoryEstimate.branches)

    @property
    def estimate_error(self) -> float | None:
        return None if self.estimate is None or not self.truth else (self.estimate - self.truth) / self.truth

    @property
    def live_error(self) -> float | None:
        if not self.live or not self.live_truth:
            return None
        return max(abs(a - b) / b for a, b in zip(self.live, self.live_truth, strict=False))

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "estimate_error": self.estimate_error, "live_error": self.live_error}


def run_draw(d: Draw | TrlDraw, *, auto: bool = False) -> DrawResult:
    """Measure draw ``d`` (module doc); an error building or training it is recorded, not raised."""
    result = DrawResult(d)
    build = builder(d) if isinstance(d, Draw) else trl_builder(d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compared = compare(build, d.describe(), with_estimate=True)
    except Exception as exc:  # noqa: BLE001 - a configuration the libraries refuse: reported, not measured
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return result
    result.truth, result.estimate, result.branches = compared.without, compared.estimate, compared.branches
    result.live, result.live_truth = compared.live, compared.truth
    if auto and result.truth:
        _run_auto(d, result)
    return result


DEPTHS = (4, 5, 6, 8)


def depth_check(d: Draw) -> tuple[int, int | None, int]:
    """The draw's configuration at a depth where the estimate may extrapolate (``DEPTHS``, drawn from the
    seed): ``(depth, the depth-extrapolated peak or None where the shortcut is not taken for the model,
    the full-depth replay's peak)``. They must agree to the byte (issue 37); estimates only, no training."""
    from ..estimation.estimate import estimate

    deep = Draw(**{**asdict(d), "layers": random.Random(-1 - d.seed).choice(DEPTHS)})
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = builder(deep)(out, [])
        shortcut = estimate(trainer, extrapolate_layers=True)
        full = estimate(trainer, extrapolate_layers=False)
    taken = any(note.startswith("depth extrapolated") for note in shortcut.notes)
    return deep.layers, shortcut.peak_bytes if taken else None, full.peak_bytes


def _profiled_peak(trainer: Any) -> int:
    baseline = _baseline(trainer)
    with cpu_memory_profile() as prof:
        trainer.train()
    return window_peak(prof, baseline)


def _run_auto(d: Draw, result: DrawResult) -> None:
    from ..core.errors import PlanError
    from ..integration.callback import MemWatch

    assert result.truth is not None
    budget = result.budget = int(AUTO_SHARE * result.truth)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = builder(d)(out, [MemWatch(auto=True, budget=budget, detail="light", report=False, summary=False)])
        try:
            result.auto_peak = _profiled_peak(trainer)
            result.auto = "fits" if result.auto_peak <= budget else "OVER BUDGET"
            return
        except PlanError:
            pass
    # "no plan fits": the most conservative plan by hand, measured
    least = dict(per_device_train_batch_size=1, gradient_accumulation_steps=d.batch * d.accum,
                 activation_checkpointing=d.family not in NO_CHECKPOINTING)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result.auto_peak = _profiled_peak(builder(d, **least)(out, []))
    result.auto = "no plan fits (truthful)" if result.auto_peak > budget else "no plan fits (UNTRUTHFUL)"
