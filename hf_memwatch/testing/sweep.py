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
from dataclasses import asdict, dataclass
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

    def describe(self) -> str:
        parts = [f"{self.family} L{self.layers}" + (f" h{self.hidden}" if self.hidden else ""),
                 f"{self.batch}x{self.seq_len} {self.shape}", self.precision, self.optim,
                 f"ckpt {self.checkpointing}", f"accum {self.accum}"]
        return ", ".join(parts + (["LoRA"] if self.lora else []))


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
    if d.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    return model


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
    import bitsandbytes as bnb

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


# -- measuring a draw ---------------------------------------------------------------------------------
@dataclass
class DrawResult:
    """What one draw measured (bytes; errors relative to the profiler's figure)."""

    draw: Draw
    truth: int | None = None  # the profiler's peak of the run without MemWatch
    estimate: int | None = None
    live: list[int] | None = None  # MemWatch's step peaks
    live_truth: list[int] | None = None  # the profiler's step peaks of the watched run
    auto: str | None = None  # "fits" | "no plan fits (truthful)" | "OVER BUDGET" | "no plan fits (UNTRUTHFUL)"
    auto_peak: int | None = None
    budget: int | None = None
    error: str | None = None  # the draw could not run (the configuration, not the measurement)

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


def run_draw(d: Draw, *, auto: bool = False) -> DrawResult:
    """Measure draw ``d`` (module doc); an error building or training it is recorded, not raised."""
    result = DrawResult(d)
    build = builder(d)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compared = compare(build, d.describe(), with_estimate=True)
    except Exception as exc:  # noqa: BLE001 - a configuration the libraries refuse: reported, not measured
        result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        return result
    result.truth, result.estimate = compared.without, compared.estimate
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
