"""The one catalogue of memory remedies: what each changes, when it applies, what it costs.

Every planner (the auto mode, ``hf-memwatch estimate --budget``, the planner API, the OOM
post-mortem) draws its options from :data:`REMEDIES`. A remedy that changes the training
algorithm is not a memory remedy: 8-bit AdamW replaces AdamW variants only (same update rule, the
states quantised), never SGD, Adafactor or another optimizer.

Adding a remedy: one :class:`Remedy` entry in :data:`REMEDIES` (an evaluation loop's: in
:data:`EVAL_REMEDIES`, a field of :class:`~hf_memwatch.planning.plan.EvalSetting`) with its ``unavailable`` rule, its
``options`` (the values it may give its plan field, a field of
:class:`~hf_memwatch.planning.plan.Plan`), its ``step`` (the one-step change an OOM post-mortem
names) and ``describe`` (that change in words), and its cost in
:func:`hf_memwatch.planning.chooser.relative_throughput`. The chooser's candidates, the CLI's remedy
table and the post-mortem's savings (:mod:`hf_memwatch.planning.remedies`) all follow from the entry;
for the evaluation loop, the eval planner's candidates (:func:`hf_memwatch.planning.eval_plan.eval_candidates`)
and the eval post-mortem's savings (:func:`hf_memwatch.planning.remedies.eval_single_steps`).

Example:
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(micro_batch_size=8, optim="sgd")
    >>> EIGHT_BIT_ADAMW.unavailable(run)
    "optim='sgd' is not AdamW, and replacing it would change the training algorithm"
    >>> ACCUMULATION.options(run)
    [1, 2, 4, 8]
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..core.advice import Advice
from ..core.extras import install_hint, installed
from ..core.optimizers import ADAMW_NAMES, EIGHT_BIT_NAMES
from ..core.run_config import RunConfig
from ..engines.registry import eight_bit_unavailable, engine_advice

# 8-bit AdamW is not proposed where the optimizer states are less than this share of the predicted
# peak (a LoRA run's adapters): it would save at most ~3/4 of a rounding error.
MIN_STATE_SHARE = 0.05


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order.

    Example:
        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def bitsandbytes_installed() -> bool:
    return installed("bitsandbytes")


def eight_bit_optim(device: str) -> str:
    """The 8-bit AdamW for ``device``: paged on CUDA (its states can spill to host memory)."""
    return "paged_adamw_8bit" if device == "cuda" else "adamw_bnb_8bit"


def state_bytes_floor(optim: str, trainable_params: int) -> int:
    """The fewest bytes of optimizer states ``optim`` can keep for ``trainable_params`` elements.

    A floor, not an estimate: AdamW keeps two moments per element in the parameters' dtype (at
    least 2 bytes each), 8-bit AdamW two 1-byte moments (blockwise scales and small fp32 tensors
    come on top); other optimizers are given 0.

    Example:
        >>> state_bytes_floor("adamw_torch", 1000), state_bytes_floor("adamw_bnb_8bit", 1000), state_bytes_floor("sgd", 1000)
        (4000, 2000, 0)
    """
    if optim in ADAMW_NAMES:
        return 4 * trainable_params
    return 2 * trainable_params if optim in EIGHT_BIT_NAMES else 0


def _first_other(run: RunConfig, value: Any, options: list[Any]) -> Any:
    """The first option other than the run's own ``value`` (None: there is none)."""
    return next((option for option in options if option != value), None)


def _says(run: RunConfig, plan: Any) -> str:
    return ", ".join(plan.changes_from(run))


@dataclass(frozen=True)
class Remedy:
    """One memory remedy: the plan field it sets and the values it may give it.

    ``unavailable(run)`` says why it cannot be used on ``run`` (None: it can); ``options(run)`` are
    the values of ``field`` it allows, the run's own value included; ``step(run, value, options)`` is
    the value of the remedy applied alone, one step from the run's ``value`` (None: no such step);
    ``describe(run, plan)`` that step in words; ``note(run)`` what a post-mortem adds to it;
    ``applied``: a planner may apply it (False: advice, it changes what the run computes).
    """

    name: str
    field: str
    unavailable: Callable[[RunConfig], str | None]
    options: Callable[[RunConfig], list[Any]]
    step: Callable[[RunConfig, Any, list[Any]], Any] = _first_other
    describe: Callable[[RunConfig, Any], str] = _says
    note: Callable[[RunConfig], str] = lambda run: ""
    applied: bool = True


def _accumulation_options(run: RunConfig) -> list[int]:
    return [run.micro_batch_size] if run.micro_batch_fixed else divisors(run.effective_batch)


def _accumulation_unavailable(run: RunConfig) -> str | None:
    return run.micro_batch_fixed


def _accumulation_step(run: RunConfig, micro: int, options: list[int]) -> int | None:
    """The next smaller micro-batch that keeps the effective batch (the largest saving's first step)."""
    return max((m for m in options if m < micro), default=None)


def _accumulation_says(run: RunConfig, plan: Any) -> str:
    return (f"micro-batch {run.micro_batch_size} -> {plan.micro_batch_size}, gradient accumulation "
            f"{run.gradient_accumulation_steps} -> {plan.gradient_accumulation_steps} (same effective batch)")


def _checkpointing_unavailable(run: RunConfig) -> str | None:
    return None if run.activation_checkpointing else run.checkpointing_unavailable


def _checkpointing_options(run: RunConfig) -> list[bool]:
    return [run.activation_checkpointing] if run.activation_checkpointing or run.checkpointing_unavailable else [False, True]


def _checkpointing_step(run: RunConfig, on: bool, options: list[bool]) -> bool | None:
    return True if not on and True in options else None


def _eight_bit_unavailable(run: RunConfig) -> str | None:
    if run.custom_optimizer:
        return "a custom optimizer was handed to the Trainer"
    if run.optim in EIGHT_BIT_NAMES:
        return None
    if (engine_says := eight_bit_unavailable(run)) is not None:  # the run's engine (engines/registry.py)
        return engine_says
    if run.optim not in ADAMW_NAMES:
        return f"optim={run.optim!r} is not AdamW, and replacing it would change the training algorithm"
    share = run.optimizer_state_share
    if share is not None and share < MIN_STATE_SHARE:
        # LoRA/QLoRA: quantising states of a few adapter parameters saves nothing worth a changed optimizer
        return (f"the optimizer states are {100 * share:.1f}% of the predicted peak (below "
                f"{100 * MIN_STATE_SHARE:.0f}%): 8-bit states would save almost nothing")
    if not bitsandbytes_installed():
        return f"bitsandbytes is not installed ({install_hint('bitsandbytes')})"
    return None


def _eight_bit_options(run: RunConfig) -> list[str]:
    if run.optim in EIGHT_BIT_NAMES or _eight_bit_unavailable(run):
        return [run.optim]
    return [run.optim, eight_bit_optim(run.device)]


ACCUMULATION = Remedy("gradient accumulation", "micro_batch_size", _accumulation_unavailable, _accumulation_options,
                      _accumulation_step, _accumulation_says)
CHECKPOINTING = Remedy("activation checkpointing", "activation_checkpointing", _checkpointing_unavailable,
                       _checkpointing_options, _checkpointing_step, lambda run, plan: "activation checkpointing on")
EIGHT_BIT_ADAMW = Remedy("8-bit AdamW", "optim", _eight_bit_unavailable, _eight_bit_options,
                         describe=lambda run, plan: f"8-bit AdamW (optim='{plan.optim}')")

REMEDIES: tuple[Remedy, ...] = (ACCUMULATION, CHECKPOINTING, EIGHT_BIT_ADAMW)


# -- the evaluation loop's remedies (fields of plan.EvalSetting) ------------------------------------
EVAL_ACCUMULATION_OPTIONS = (1,)  # eval_accumulation_steps tried when outputs must leave the device


def _available(run: RunConfig) -> str | None:
    return None


def _eval_batches(run: RunConfig) -> list[int]:
    """The configured eval batch halved down to 1, largest first."""
    given = int(run.eval_batch_size or 8)
    return sorted({max(1, given >> shift) for shift in range(given.bit_length())}, reverse=True)


def _eval_accumulations(run: RunConfig) -> list[int | None]:
    """The run's own; on an accelerator, where outputs stay on the device, also moved off every batch
    (on the CPU the device is the host: moving outputs "off" it saves nothing)."""
    steps: list[int | None] = [run.eval_accumulation_steps]
    if run.device != "cpu" and run.eval_accumulation_steps is None:
        steps.extend(EVAL_ACCUMULATION_OPTIONS)
    return steps


def _cpu_accumulation_note(run: RunConfig) -> str:
    return "on the CPU numpy holds the same bytes in host memory: no saving in RAM" if run.device == "cpu" else ""


def _switched_on(run: RunConfig, on: bool, options: list[bool]) -> bool | None:
    return True if not on else None


EVAL_BATCH = Remedy(
    "smaller eval batch", "eval_batch_size", _available, _eval_batches, _accumulation_step,
    lambda run, s: f"per_device_eval_batch_size {int(run.eval_batch_size or 8)} → {s.eval_batch_size}")
EVAL_ACCUMULATION = Remedy(
    "eval accumulation", "eval_accumulation_steps", _available, _eval_accumulations,
    lambda run, steps, options: 1 if steps != 1 else None,
    lambda run, s: "eval_accumulation_steps=1 (outputs leave the device every batch)", _cpu_accumulation_note)
EVAL_ARGMAX = Remedy(
    "logits reduced for metrics", "preprocess_argmax", _available, lambda run: [False], _switched_on,
    lambda run, s: "preprocess_logits_for_metrics = lambda logits, labels: logits.argmax(-1)", applied=False)
EVAL_LOSS_ONLY = Remedy(
    "loss only", "prediction_loss_only", _available, lambda run: [bool(run.prediction_loss_only)], _switched_on,
    lambda run, s: "prediction_loss_only=True (no logits or labels kept; no metrics beyond the loss)", applied=False)

EVAL_REMEDIES: tuple[Remedy, ...] = (EVAL_BATCH, EVAL_ACCUMULATION, EVAL_ARGMAX, EVAL_LOSS_ONLY)


def unavailable_remedies(run: RunConfig) -> dict[str, str]:
    """Remedy name -> why it cannot be used on ``run``."""
    return {remedy.name: why for remedy in REMEDIES if (why := remedy.unavailable(run))}


def precision_advice(run: RunConfig) -> tuple[str, RunConfig] | None:
    """bf16 mixed precision as advice where the run is in fp32 (it changes numerics, so no planner
    applies it by itself): what an OOM post-mortem names beside the remedies.

    Example:
        >>> precision_advice(RunConfig(micro_batch_size=8))[0]
        'bf16 mixed precision (advice: changes numerics)'
    """
    if run.precision != "fp32":
        return None
    return "bf16 mixed precision (advice: changes numerics)", run.replace(precision="bf16")


def with_state_share(run: RunConfig, estimate: Any) -> RunConfig:
    """``run`` with ``optimizer_state_share`` from a predicted step (a ``MemoryEstimate`` of ``run``):
    what the 8-bit AdamW rule reads."""
    peak = int(getattr(estimate, "peak_bytes", 0) or 0)
    states = int((getattr(estimate, "classes", None) or {}).get("optimizer_states", 0))
    return run.replace(optimizer_state_share=states / peak if peak > 0 else None)


REFERENCE_MODEL = "ref_model"  # the attribute TRL's preference trainers hold their reference model in


def advice(run: RunConfig, frozen_models: Mapping[str, int], logits: int = 0, peak: int = 0,
           classes: Mapping[str, int] | None = None, peak_phase: str | None = None) -> list[Advice]:
    """Advice for ``run`` whose Trainer holds the frozen models ``frozen_models`` (name -> resident
    bytes, as :func:`hf_memwatch.estimate` and the live monitor report them) and whose step peaks at
    ``peak`` bytes with ``logits`` bytes of logits (and their fp32 upcast) live at that moment;
    with ``classes`` (the predicted per-rank split at the peak) the engine-level remedies of a
    distributed run too (:func:`hf_memwatch.engines.registry.engine_advice`; ``peak_phase``: the
    phase of the peak, where it is known).

    A TRL preference trainer (DPO: ``precompute_ref_log_probs`` is one of its options) holding a copied
    reference model can drop it: its bytes are the saving. A language-model step whose logits take
    :data:`LOGITS_ADVICE_SHARE` of its peak or more can compute its loss without them: the fused or
    chunked cross-entropy routes of the installed stack (:func:`fused_loss_advice`; not for a
    preference trainer, whose loss they do not replace).

    Example:
        >>> run = RunConfig(micro_batch_size=4, precompute_ref_log_probs=False)
        >>> [a.name for a in advice(run, {"ref_model": 1000})]
        ['precompute_ref_log_probs=True, ref_model=None', 'LoRA policy, ref_model=None']
    """
    # The fused routes replace a plain language-model loss; a preference trainer's (DPO) has none of them.
    found = fused_loss_advice(logits, peak, run.device) if run.precompute_ref_log_probs is None else []
    if classes:  # the engine's own remedies (ZeRO stage, offload, buckets), from the predicted split
        found.extend(engine_advice(run, classes, peak, peak_phase))
    reference = int(frozen_models.get(REFERENCE_MODEL, 0) or 0)
    if reference <= 0 or run.precompute_ref_log_probs is None:
        return found
    if run.precompute_ref_log_probs:
        found.append(Advice("ref_model=None", reference, "the reference log-probs are already precomputed: the "
                                                         "reference model passed to the trainer is not needed"))
    else:
        found.append(Advice("precompute_ref_log_probs=True, ref_model=None", reference,
                            "the reference log-probs are computed once before training (one forward pass over "
                            "the dataset) and no reference model is held while training"))
    if run.peft_model:
        found.append(Advice("ref_model=None (PEFT policy)", reference,
                            "the policy is a PEFT model: with its adapter disabled it is the reference"))
    else:
        found.append(Advice("LoRA policy, ref_model=None", reference,
                            "train a LoRA adapter (peft_config=...): the model with the adapter disabled is the "
                            "reference; gradients and optimizer states shrink too (not counted here)"))
    return found


# Logits advice only where the logits are a real part of the peak (not for a classifier's few labels).
LOGITS_ADVICE_SHARE = 0.05


def fused_loss_advice(logits: int, peak: int, device: str = "cuda") -> list[Advice]:
    """The routes to a loss without the full logits that exist in the installed stack, each saving up
    to ``logits`` (the logits and their fp32 upcast live at the peak; a chunk of them remains); only
    those that run on ``device`` (Liger's kernels are Triton kernels: CUDA only, not advised to a CPU run).

    Example:
        >>> [a.name.split(" ")[0] for a in fused_loss_advice(300, 1000)]
        ['use_liger_kernel=True', 'trl.SFTTrainer']
        >>> [a.name.split(" ")[0] for a in fused_loss_advice(300, 1000, device="cpu")]
        ['trl.SFTTrainer']
        >>> fused_loss_advice(10, 1000)
        []
    """
    if logits <= 0 or peak <= 0 or logits < LOGITS_ADVICE_SHARE * peak:
        return []
    found = []
    liger = importlib.util.find_spec("liger_kernel") is not None
    if device == "cuda":
        found.append(Advice(
            "use_liger_kernel=True (Liger fused linear cross-entropy)", logits,
            "the LM head and the loss are computed in chunks, the logits never whole; CUDA only (Triton kernels); "
            + ("liger-kernel is installed" if liger else "needs pip install liger-kernel")))
    if importlib.util.find_spec("trl") is not None:
        found.append(Advice(
            "trl.SFTTrainer (its fused LM head)", logits,
            "TRL's SFTTrainer computes the per-token log-probabilities in chunks without materialising the "
            "logits (any device); the run's data must suit SFT"))
    return found
