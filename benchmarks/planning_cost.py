"""What planning costs at real model sizes, in CPU seconds: the old path and the new side by side.

For Llama-3.2-1B, Llama-3.1-8B and Llama-3.1-70B-shaped configs (the published ``config.json`` figures:
hidden size, layers, heads, KV heads, intermediate size, vocabulary), bf16 on a CUDA target, micro-batch
8 x 2048 tokens, full fine-tuning, LoRA (r=16 on every linear layer) and ZeRO-3 over 8 ranks:

(a) the import floor: ``torch``, ``transformers.modeling_utils`` and the Llama modeling code;
(b) one estimate of the run as configured, above that floor (hf-memwatch's imports and lazy imports
    included: what a user pays);
(c) the full plan (:func:`hf_memwatch.planning.planner.plan_for`) with a budget of 60% of the run's
    estimated peak (so a plan must be searched), above the floor;
(d) the same plan in a process that imported peft and bitsandbytes before its clock started (a Trainer run
    that built its ``PeftModel`` or uses bitsandbytes has), and that import's own cost;
(e) (d) again with the optimizer swap off (:func:`hf_memwatch.estimation.optimizer_swap.swap_off`): what
    replaying the micro-steps once per micro-batch/checkpointing line saves.

The new path's LoRA rows build the adapted model at the 4 layers the replays keep
(``estimation/short_model.py``), the old one all of them.

Every measurement runs in its own fresh subprocess (process CPU time, ``time.process_time``), once
with the planning shortcuts off (``hf_memwatch.estimation.memo.shortcuts(False)``: today's code
path) and once on. The run fails (exit 1) unless both paths give the same estimate bytes (peak,
reserve, split, phase peaks), the same chosen plan and the same predicted bytes for every plan both
predicted.

    python benchmarks/planning_cost.py --out benchmarks/results/planning_cost.md
    python benchmarks/planning_cost.py --shapes 1B --variants full     # one case
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The published config.json figures (meta-llama/Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B).
SHAPES = {
    "1B": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072),
    "8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072),
    "70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256, max_position_embeddings=131072),
}
RUN = dict(micro_batch_size=8, seq_len=2048, precision="bf16", device="cuda")
VARIANTS = {
    "full": ({}, {}),
    "LoRA": ({}, {"lora": {"r": 16, "targets": "all-linear"}}),
    "ZeRO-3": ({"world_size": 8, "shard": "zero3"}, {}),
}
BUDGET_SHARE = 0.6  # of the run's estimated peak: the run as configured does not fit, a plan is searched


# -- one measurement, in its own process ------------------------------------------------------
def child(spec: dict) -> dict:
    """Run one measurement (``spec``: kind, shape, variant, shortcuts, budget) and return its figures."""
    start_wall = time.perf_counter()
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama  # noqa: F401

    floor = time.process_time()
    out: dict = {"floor": floor}
    if spec["kind"] == "floor":
        return out
    if spec.get("preload"):  # as in a Trainer run that built its PeftModel / imported bitsandbytes already
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401

        out["preload"] = time.process_time() - floor
        floor = time.process_time()
    import warnings

    warnings.simplefilter("ignore")
    from hf_memwatch.core.run_config import RunConfig
    from hf_memwatch.estimation.memo import shortcuts

    config = LlamaConfig(**SHAPES[spec["shape"]])
    run_fields, extra = VARIANTS[spec["variant"]]
    extra = dict(extra)
    if "lora" in extra:
        from hf_memwatch.estimation.peft import LoraSpec

        extra["lora"] = LoraSpec(**extra["lora"])
    run = RunConfig(**RUN, **run_fields)
    from contextlib import nullcontext

    from hf_memwatch.estimation.optimizer_swap import swap_off

    with shortcuts(spec["shortcuts"]), (swap_off() if spec.get("swap_off") else nullcontext()):
        if spec["kind"] == "estimate":
            from hf_memwatch import estimate

            result = estimate(config, **run.estimate_kwargs(), **extra)
            out["estimate"] = {"peak_bytes": result.peak_bytes, "reserved_bytes": result.reserved_bytes,
                               "classes": result.classes, "phase_peaks": result.phase_peaks}
        else:
            from hf_memwatch.planning.chooser import plan_run
            from hf_memwatch.planning.predict import EstimatorPredictor

            predictor = EstimatorPredictor(config, run, extra=extra)  # plan_for's, its counts kept
            result = plan_run(run, predictor, spec["budget"])
            out["chosen"] = None if result.chosen is None else result.chosen.as_dict()
            out["predicted"] = {json.dumps(p.key()): p.predicted_peak for p in result.candidates
                                if p.predicted_peak is not None}
            out["predictions"] = f"{predictor.calls}+{predictor.floor_calls}"
    out["cpu"] = time.process_time() - floor
    out["wall"] = time.perf_counter() - start_wall
    return out


def measure(spec: dict) -> dict:
    """``spec`` measured in a fresh interpreter (2 torch threads, offline)."""
    env = dict(os.environ, OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{spec}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


# -- the table ---------------------------------------------------------------------------------
def compare(old: dict, new: dict, what: str) -> list[str]:
    """Where the two paths disagree (empty: byte for byte the same)."""
    problems = []
    if what == "estimate" and old["estimate"] != new["estimate"]:
        problems.append(f"estimate differs: {old['estimate']} vs {new['estimate']}")
    if what == "plan":
        if old["chosen"] != new["chosen"]:
            problems.append(f"chosen plan differs: {old['chosen']} vs {new['chosen']}")
        both = set(old["predicted"]) & set(new["predicted"])
        problems += [f"{key}: {old['predicted'][key]} vs {new['predicted'][key]}" for key in sorted(both)
                     if old["predicted"][key] != new["predicted"][key]]
    return problems


def describe(chosen: dict | None) -> str:
    if chosen is None:
        return "nothing fits"
    return (f"{chosen['micro_batch_size']}x{chosen['gradient_accumulation_steps']}"
            f"{' ckpt' if chosen['activation_checkpointing'] else ''} {chosen['optim']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    from overhead import publish

    rows, floors, problems = [], [], []
    for shape in args.shapes:
        for variant in args.variants:
            base = {"shape": shape, "variant": variant}
            est = {on: measure({**base, "kind": "estimate", "shortcuts": on}) for on in (False, True)}
            budget = int(est[False]["estimate"]["peak_bytes"] * BUDGET_SHARE)
            plan = {on: measure({**base, "kind": "plan", "shortcuts": on, "budget": budget}) for on in (False, True)}
            found = compare(est[False], est[True], "estimate") + compare(plan[False], plan[True], "plan")
            preloaded = measure({**base, "kind": "plan", "shortcuts": True, "budget": budget, "preload": True})
            unswapped = measure({**base, "kind": "plan", "shortcuts": True, "budget": budget, "preload": True,
                                 "swap_off": True})
            found += compare(plan[True], preloaded, "plan") + compare(plan[True], unswapped, "plan")
            problems += [f"{shape} {variant}: {p}" for p in found]
            floors += [m["floor"] for m in (*est.values(), *plan.values(), preloaded, unswapped)]
            rows.append(f"| {shape} | {variant} | {budget / 2**30:.1f} GiB | {est[False]['cpu']:.2f} -> "
                        f"{est[True]['cpu']:.2f} | {plan[False]['cpu']:.2f} -> {plan[True]['cpu']:.2f} | "
                        f"{preloaded['cpu']:.2f} ({preloaded['preload']:.2f}) | {unswapped['cpu']:.2f} | "
                        f"{plan[False]['predictions']} -> {plan[True]['predictions']} | "
                        f"{describe(plan[True]['chosen'])} | {'same' if not found else 'DIFFERENT'} |")
            print(rows[-1], flush=True)
    lines = [
        "# Planning cost at real model sizes (CPU seconds, old path -> new)",
        "",
        f"`python benchmarks/planning_cost.py`; {platform.machine()}, {os.cpu_count()} CPU(s), 2 torch threads, "
        f"each figure from its own fresh process (`time.process_time`). Llama-shaped configs from the published "
        f"config.json figures; bf16, CUDA target (default card), micro-batch 8 x 2048 tokens, budget = "
        f"{BUDGET_SHARE:.0%} of the run's estimated peak. Estimate and plan: CPU seconds *above* the import "
        f"floor (hf-memwatch's own imports, the Trainer's and bitsandbytes' where the replay needs them, "
        f"included). Old = planning shortcuts off (`memo.shortcuts(False)`), new = on; \"same\": the estimate "
        f"bytes, the chosen plan and every figure both paths predicted are identical.",
        "",
        f"Import floor (torch + transformers.modeling_utils + modeling_llama): median "
        f"{statistics.median(floors):.2f} s CPU over {len(floors)} processes.",
        "",
        "Full plan, libraries imported: the new path in a process that imported peft and bitsandbytes before "
        "the clock started, as a Trainer run has that built its PeftModel or uses bitsandbytes (in brackets: "
        "that import's own CPU seconds, peft importing bitsandbytes, whose `torch.compile` pulls in "
        "`torch._inductor`); the estimate imports them itself where the replay needs them (LoRA: peft; a plan "
        "weighing 8-bit AdamW: bitsandbytes). Swap off: that process again with the optimizer swap off "
        "(`optimizer_swap.swap_off()`: every candidate's micro-steps replayed, the other shortcuts on).",
        "",
        "| shape | variant | budget | one estimate (s) | full plan (s) | full plan, libraries imported (s) | "
        "same, swap off (s) | estimates in the plan (full+floor) | chosen plan | old vs new |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    publish(lines, args.out)
    for problem in problems:
        print("DIFFERENT:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
