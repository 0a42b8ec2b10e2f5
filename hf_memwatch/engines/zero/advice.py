"""Engine-level memory remedies of a distributed run: a higher ZeRO stage, optimizer offload, a
smaller reduce bucket — part of the one catalogue (:func:`hf_memwatch.planning.catalogue.advice`,
through :func:`hf_memwatch.engines.registry.engine_advice`; DDP's rules advise ZeRO-1 with
:func:`ddp_to_zero1`, ZeRO's the rest with :func:`zero_advice`).

They are advice, never applied by a planner: a ZeRO stage or an offload device changes the engine
that runs (its collectives, where the optimizer step runs: DeepSpeed's CPU Adam under offload), so
the run would not be the hand-configured run of the plan. The reduce bucket changes nothing in the
numerics, but the engine is built from the DeepSpeed JSON inside ``train()``; it is advised with its
saving here, not yet applied.

The savings are per rank, from the predicted split at the peak (``classes``) and the engine the run
has (:class:`~hf_memwatch.engines.engine.Engine`), with the rules of
:mod:`hf_memwatch.engines.zero.split` (fp32, N ranks, W weights, G gradients, S optimizer states at
the peak, P = W / 4 trainable elements):

==============================  =========================================================
DDP -> DeepSpeed ZeRO-1         DDP's buckets (W) go, the states are partitioned with an
                                fp32 master partition: W + S (1 - 1/N) - W / N
ZeRO-1 -> ZeRO-2                gradients partitioned, one reduce bucket kept:
                                G (1 - 1/N) - bucket
ZeRO-1/2/3, offload_optimizer   the states (S) leave the device, on an accelerator only (on
                                CPU ranks host RAM is the device: nothing saved)
ZeRO-2/3 reduce bucket          ``reduce_bucket_size`` / 4: 3/4 of the bucket, where it is at
                                least 5% of the peak
==============================  =========================================================

The reduce bucket of ZeRO-1/2 lives inside the backward only (``engines/zero/backward.py``: set
up at each backward's first gradient, released at its end), so it is advised only where the peak is
the backward (``peak_phase``); a plan that peaks in the optimizer step holds no bucket there
(measured on 2 gloo ranks, test GPT-2, ZeRO-2, 1 x 8 + checkpointing: the same step peaks,
10,719,772 / 10,734,116 B on rank 0, with buckets of 100,000 and 25,000 elements). It stays advice,
not applied: it could be written into the DeepSpeed JSON before ``train()`` (the Trainer copies
``accelerator.state.deepspeed_plugin.hf_ds_config.config`` into the engine it builds there), but on
more than 2 ranks the reductions' grouping, hence their float sums, may change with it.

When no plan fits, :mod:`hf_memwatch.planning.no_fit` says what the smallest plan holds at its peak and which of
these remedies apply (or why none does: :func:`no_fit_reasons`), for the ``PlanError``'s message.

ZeRO-2 -> ZeRO-3 is not advised by default: with ``stage3_max_reuse_distance`` and
``stage3_max_live_parameters`` at DeepSpeed's defaults (1e9 elements) a model below them stays
gathered whole from forward to backward (measured on 2 gloo ranks: weights 1,180,672 B partition +
2,361,344 B gathered), so the weights saved are spent again.

Example:
    >>> from hf_memwatch.engines.engine import Engine
    >>> from hf_memwatch.core.run_config import RunConfig
    >>> run = RunConfig(micro_batch_size=4, world_size=2, engine=Engine(kind="ddp", world_size=2))
    >>> split = {"weights": 400, "gradients": 800, "optimizer_states": 800}
    >>> [(a.name, a.saving) for a in ddp_to_zero1(run, split)]
    [('DeepSpeed ZeRO-1 (deepspeed={"zero_optimization": {"stage": 1}})', 600)]
"""

from __future__ import annotations

from collections.abc import Mapping

from ...core.advice import Advice
from ...core.categories import AFTER_BACKWARD
from ...core.run_config import RunConfig

# A bucket smaller than this share of the peak is not worth a line of advice.
BUCKET_ADVICE_SHARE = 0.05


def is_ddp(run: RunConfig) -> bool:
    """Whether ``run`` is DDP over 2+ ranks (its engine's, else its plain ``shard`` none)."""
    engine = run.engine
    if engine is not None:
        return engine.kind == "ddp" and engine.world_size > 1
    return run.world_size > 1 and run.shard == "none"


def _zero(run: RunConfig) -> bool:
    engine = run.engine
    world = engine.world_size if engine is not None else run.world_size
    return engine is not None and engine.kind == "deepspeed" and engine.zero_stage in (1, 2, 3) and world >= 2


def ddp_to_zero1(run: RunConfig, classes: Mapping[str, int]) -> list[Advice]:
    """DDP -> DeepSpeed ZeRO-1 for a DDP ``run`` (see the module doc), where it saves something."""
    if not is_ddp(run):
        return []
    weights = int(classes.get("weights", 0))
    states = int(classes.get("optimizer_states", 0))
    world = run.engine.world_size if run.engine is not None else run.world_size
    saving = weights + states - states // world - weights // world
    if saving <= 0:
        return []
    return [Advice(
        'DeepSpeed ZeRO-1 (deepspeed={"zero_optimization": {"stage": 1}})', saving,
        f"the optimizer states are partitioned over the {world} ranks (an fp32 master partition "
        "on top) and DDP's gradient buckets are not kept; the engine changes (DeepSpeed's collectives)")]


def zero_advice(run: RunConfig, classes: Mapping[str, int], peak: int,
                peak_phase: str | None = None) -> list[Advice]:
    """The ZeRO remedies for a DeepSpeed ``run`` (see the module doc), each with its saving in bytes per
    rank; only those that save something (``peak_phase``: where the peak is, None: not known)."""
    if not _zero(run):
        return []
    grads = int(classes.get("gradients", 0))
    states = int(classes.get("optimizer_states", 0))
    engine, world = run.engine, run.engine.world_size
    found: list[Advice] = []
    size = 2 if run.precision in ("bf16", "fp16") else 4
    bucket = min(int(engine.reduce_bucket_size or 0) * size, grads) if engine.zero_stage >= 2 else 0
    if engine.zero_stage < 3 and peak_phase not in (None, AFTER_BACKWARD):
        bucket = 0  # ZeRO-1/2's bucket is released at the backward's end: none at this peak
    if engine.zero_stage == 1:
        bucket_next = min(int(engine.reduce_bucket_size or 0) * size, grads)
        saving = grads - grads // world - bucket_next
        if saving > 0:
            found.append(Advice(
                'ZeRO-2 ("zero_optimization": {"stage": 2})', saving,
                "gradients are reduced into partitions (one reduce bucket kept) instead of kept whole on each rank"))
    if engine.offload_optimizer == "none" and run.device != "cpu" and states > 0:
        found.append(Advice(
            'optimizer offload ("offload_optimizer": {"device": "cpu"})', states,
            "the optimizer states and the fp32 master partition live in host RAM and DeepSpeed steps them "
            "there (host RAM counts against the host limit; the step runs on the CPU)"))
    if bucket and peak > 0 and bucket >= BUCKET_ADVICE_SHARE * peak:
        smaller = max(1, int(engine.reduce_bucket_size or 0) // 4)
        found.append(Advice(
            f'reduce_bucket_size={smaller} ("zero_optimization": {{"reduce_bucket_size": {smaller}}})',
            bucket - min(smaller * size, bucket),
            "a smaller reduce bucket holds fewer gradient bytes at once; more (smaller) reductions run "
            "(the same sums on 2 ranks; on more, their float grouping may change)"))
    return found


def no_fit_reasons(run: RunConfig, peak_phase: str) -> list[str] | None:
    """Why no ZeRO remedy applies to a DeepSpeed ``run`` that no plan fits (None: not a ZeRO run)."""
    if not _zero(run):
        return None
    engine = run.engine
    why = []
    if engine.offload_optimizer == "none" and run.device == "cpu":
        why.append("optimizer offload saves nothing on CPU ranks (host RAM is the device)")
    if engine.zero_stage >= 2:
        why.append("the reduce bucket is released at the end of the backward, before this peak"
                   if engine.zero_stage < 3 and peak_phase != AFTER_BACKWARD else
                   f"the reduce bucket is under {BUCKET_ADVICE_SHARE:.0%} of the peak")
    if engine.zero_stage < 3:
        why.append("ZeRO-3 is not predicted here (a model under its live-parameter limits stays gathered whole: "
                   "try hf-memwatch estimate --shard zero3)")
    return why
