"""Per-rank accuracy of the FSDP2 prediction on 2 CPU ranks (issue 19, point 2).

Launches itself with ``torchrun --nproc-per-node 2`` (gloo). Each rank runs, per configuration, a real
``Trainer`` under FSDP2 (``fsdp="full_shard"``, ``fsdp_version: 2``, ``fully_shard`` on every
``transformer_layer_cls_to_wrap`` block and the root, built by accelerate's ``fsdp2_prepare_model``;
accelerate's one device-type switch flipped by ``hf_memwatch.testing.fsdp_cpu``), 3 optimizer steps,
without MemWatch. Before ``train()`` it records ``estimate(trainer)`` (no FSDP wrapping yet) and,
for comparison, the rule the estimator used before the replay (``shard_classes``' "fsdp": states,
gradients and weights / N + 2 x the largest layer). The truth is the profiler's per-rank step peak,
profiled from the model's construction on, the frees gloo's worker threads make reconciled
(``hf_memwatch.testing.truth``: ``remembered_allocations``, ``reconcile=True`` with
``alive_storages``). Usage: ``python benchmarks/fsdp2_accuracy.py --out benchmarks/results/fsdp2_accuracy.md``
(``--only NAME`` runs one configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name: (family, micro-batch, accumulation, tokens, reshard_after_forward, checkpointing, optim)
CONFIGS = {
    "gpt2": ("gpt2", 4, 1, 32, True, False, "adamw_torch"),
    "gpt2_keep": ("gpt2", 4, 1, 32, False, False, "adamw_torch"),
    "gpt2_accum2": ("gpt2", 4, 2, 32, True, False, "adamw_torch"),
    "gpt2_ckpt": ("gpt2", 4, 1, 64, True, True, "adamw_torch"),
    "gpt2_long": ("gpt2", 2, 1, 128, True, False, "adamw_torch"),
    "llama": ("llama", 4, 1, 32, True, False, "adamw_torch"),
    "llama_keep_ckpt": ("llama", 4, 2, 64, False, True, "adamw_torch"),
}
# Not run: 8-bit AdamW. Under FSDP2 on CPU its step fails (bitsandbytes.optimizer_update_32bit has no
# DTensor sharding strategy: NotImplementedError, measured with adamw_bnb_8bit here).
WRAP = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
NOTES = """
Gloo's race (``engines/fsdp2/replay.py``, ``Fsdp2Flow._issued``): a finished collective's work keeps its buffers
(the all-gather's flat output, the reduce-scatter's input and output) until the worker thread that ran it resets
it, before or after the training thread's next allocations. The reconciled truth frees them when FSDP drops them;
the estimate's branch that does the same is the error column, and the estimate itself (what the planner plans
from) is the race's worst branch: each of gloo's two workers still holding its last work, the last two
collectives' buffers alive until the next ones are issued. It lies above every high bound in the table (each free
on gloo's thread at the latest time the profiler allows).

Step 1 is not in the error: its forward and backward run before AdamW creates its states (in step 1's
optimizer step), so its peak is lower than the steady steps' by the states of the rank's shards; the
estimate predicts the steady step (states resident), the run's peak. 8-bit AdamW was not run: under
FSDP2 on CPU its step raises NotImplementedError (``bitsandbytes.optimizer_update_32bit`` has no DTensor
sharding strategy). The accumulation runs need ``hf_memwatch.testing.fsdp_cpu`` to keep accelerate's
state FSDP through ``train()`` (before, it reverted to MULTI_CPU, so ``no_sync`` was DDP's, a no-op on
FSDP2, and every micro-step reduce-scattered).
"""
ESTIMATE_MARK = "fsdp2_accuracy.estimate"


def model_of(family: str):
    import torch

    torch.manual_seed(0)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=512,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                        max_position_embeddings=512))


def dataset(n: int, seq_len: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        ids = torch.randint(0, 1000, (seq_len,), generator=gen)
        items.append({"input_ids": ids, "labels": ids.clone()})

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(items)

        def __getitem__(self, i: int):
            return items[i]

    return Items()


def rule_peak(trainer) -> int:
    """The prediction of the rule used before the replay (``shard_classes``' "fsdp": states, gradients and
    weights / N + 2 x the largest layer): an engine of another layout than the request's leaves the rule alone."""
    from hf_memwatch.engines.engine import Engine
    from hf_memwatch.estimation import estimate

    return estimate(trainer, engine=Engine(kind="ddp", world_size=2), shard="fsdp", world_size=2).peak_bytes


def run_one(out: Path, name: str) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    from hf_memwatch.estimation import estimate
    from hf_memwatch.testing.truth import (
        StepMarker,
        alive_storages,
        cpu_memory_deltas,
        cpu_memory_profile,
        remembered_allocations,
        step_peaks,
    )

    family, batch, accum, tokens, reshard, ckpt, optim = CONFIGS[name]
    prime = remembered_allocations()
    data = dataset(64, tokens)
    args = TrainingArguments(
        output_dir=str(out / name), per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        gradient_checkpointing=ckpt, optim=optim, max_steps=3, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True, fsdp="full_shard",
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [WRAP[family]],
                     "reshard_after_forward": reshard})
    prime.stop()
    profiler = cpu_memory_profile(record_shapes=True)
    profiler.start()
    trainer = Trainer(model=model_of(family), args=args, train_dataset=data, callbacks=[StepMarker()])
    with torch.profiler.record_function(ESTIMATE_MARK):  # its leftovers (caches) are no training bytes
        predicted = estimate(trainer)
        try:
            before = rule_peak(trainer)
        except Exception as exc:  # noqa: BLE001 - the old rule's figure is informative only
            before = f"{type(exc).__name__}: {exc}"
    try:
        trainer.train()
    finally:
        profiler.stop()
    alive = alive_storages()
    (start, end), = [(e.start_ns(), e.end_ns()) for e in profiler.profiler.kineto_results.events()
                     if e.name() == ESTIMATE_MARK]
    left = sum(delta for time, delta in cpu_memory_deltas(profiler) if start <= time <= end)
    return {"truth": step_peaks(profiler, -left, reconcile=True, alive=alive),
            "high": step_peaks(profiler, -left, reconcile=True, alive=alive, late=True),  # late frees at their latest
            "raw": step_peaks(profiler, -left), "predicted": predicted.peak_bytes,
            "branches": dict(predicted.branches),  # gloo's race: both branches (estimation/branches.py)
            "predicted_phase": predicted.peak_phase, "phase_peaks": predicted.phase_peaks, "rule": before,
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r],
            "wrapped": type(trainer.model_wrapped).__name__}


def worker(out: Path, names: list[str], repeat: int = 1) -> None:
    import torch.distributed as dist

    from hf_memwatch.testing.fsdp_cpu import allow_fsdp_on_cpu_ranks

    allow_fsdp_on_cpu_ranks()
    rank = int(os.environ["RANK"])
    facts = {}
    for _ in range(repeat):  # the repetitions in one launch: the run-to-run spread (issue 37.3)
        for name in names:
            fact = run_one(out, name)
            facts.setdefault(name, dict(fact, repeats=[]))["repeats"].append(
                {key: fact[key] for key in ("truth", "high", "raw")})
            (out / f"fsdp2.rank{rank}.json").write_text(json.dumps(facts, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(out: Path, names: list[str], repeat: int = 1) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               TMPDIR=str(out))  # torch elastic's folders in the launch's, not /tmp
    log = open(out / "launch.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(port), __file__, "--worker", str(out), str(repeat), *names],
                            env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    try:
        if proc.wait(timeout=1200) != 0:
            raise SystemExit(f"the launch exited with {proc.returncode}; see {out / 'launch.log'}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit("the launch did not finish in 1200 s") from None
    finally:
        log.close()


def table(out: Path, names: list[str]) -> str:
    """Per rank and configuration: the profiler's step peaks and the prediction's error at each step
    after the first (the estimate predicts the steady step: optimizer states resident; step 1 makes
    them in its optimizer step, after its forward and backward, so its peak is lower by about them)."""
    from hf_memwatch.estimation.branches import RACE_FREED

    facts = [json.loads((out / f"fsdp2.rank{rank}.json").read_text()) for rank in (0, 1)]
    lines = ["| config (family, micro-batch x accumulation x tokens, reshard after forward, checkpointing) | rank | "
             "profiler step peaks 1, 2, 3, reconciled (B) | high bounds (B) | raw (B) | predicted before train(), "
             "freed first (B) | error, steps 2, 3 | the estimate: gloo's race held (B) | over the high bound, steps "
             "2, 3 | before: the rule (B) | rule error, steps 2, 3 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    errors, rule_errors, covers = [], [], []
    for name in names:
        family, batch, accum, tokens, reshard, ckpt, optim = CONFIGS[name]
        for rank in (0, 1):
            fact = facts[rank][name]
            truth, worst, rule = fact["truth"], fact["predicted"], fact["rule"]
            predicted = fact.get("branches", {}).get(RACE_FREED, worst)  # the branch the reconciled truth is
            steady = truth[1:]
            per_step = [predicted / t - 1 for t in steady]
            above = [worst / h - 1 for h in fact["high"][1:]]
            covers.extend(above)
            rule_steps = [rule / t - 1 for t in steady] if isinstance(rule, int) else []
            errors.extend(abs(e) for e in per_step)
            rule_errors.extend(abs(e) for e in rule_steps)
            lines.append(f"| {family} {batch} x {accum} x {tokens}, {reshard}, {ckpt} | {rank} | "
                         f"{', '.join(f'{t:,}' for t in truth)} | {', '.join(f'{t:,}' for t in fact['high'])} | "
                         f"{', '.join(f'{t:,}' for t in fact['raw'])} | "
                         f"{predicted:,} | {', '.join(f'{100 * e:+.2f}%' for e in per_step)} | {worst:,} | "
                         f"{', '.join(f'{100 * e:+.2f}%' for e in above)} | "
                         f"{rule if isinstance(rule, str) else f'{rule:,}'} | "
                         f"{', '.join(f'{100 * e:+.2f}%' for e in rule_steps)} |")
    lines += ["", f"prediction (the replay, its branch that frees each collective's buffers when FSDP drops them, as "
                  f"the reconciled truth places those frees), every rank, configuration and step after the first: "
                  f"median |error| {100 * statistics.median(errors):.2f}%, worst {100 * max(errors):.2f}% "
                  f"({len(errors)} step peaks)",
              f"the estimate itself (the race's worst branch: gloo's two workers still holding the last two "
              f"collectives' buffers, ``Fsdp2Flow._issued``) over the high bound (each free on gloo's thread at its "
              f"latest possible time): {100 * min(covers):+.2f}%..{100 * max(covers):+.2f}% "
              f"({sum(c < 0 for c in covers)} of {len(covers)} under it)"]
    if rule_errors:
        lines.append(f"the rule before (same steps): median |error| {100 * statistics.median(rule_errors):.2f}%, "
                     f"worst {100 * max(rule_errors):.2f}%")
    return "\n".join(lines) + "\n"


def spread(out: Path, names: list[str]) -> str:
    """Per configuration and rank, over the repetitions: each run's steady step peak (the largest after
    step 1) read three ways — the reconciled point figure (late frees at their last reader), the high
    bound (at their latest possible time: ``step_peak_bounds``) and the raw sum — and the spread of each."""
    facts = [json.loads((out / f"fsdp2.rank{rank}.json").read_text()) for rank in (0, 1)]
    lines = ["| config | rank | reconciled (B) | spread | high bound (B) | spread, above reconciled | raw (B) | spread |",
             "|---|---|---|---|---|---|---|---|"]
    worst = {"truth": 0.0, "high": 0.0, "raw": 0.0, "above": 0.0}
    for name in names:
        family, batch, accum, tokens, reshard, ckpt, _ = CONFIGS[name]
        for rank in (0, 1):
            repeats = facts[rank][name]["repeats"]
            cells = []
            for key in ("truth", "high", "raw"):
                values = [max(r[key][1:]) for r in repeats]
                share = (max(values) - min(values)) / min(values)
                worst[key] = max(worst[key], share)
                cells += [", ".join(f"{v:,}" for v in values), f"{100 * share:.2f}%"]
            above = max(max(r["high"][1:]) / max(r["truth"][1:]) - 1 for r in repeats)
            worst["above"] = max(worst["above"], above)
            cells[3] += f", {100 * above:+.2f}%"
            lines.append(f"| {family} {batch} x {accum} x {tokens}, {reshard}, {ckpt} | {rank} | {' | '.join(cells)} |")
    lines += ["", f"{len(repeats)} runs of each configuration in one launch. Worst spread: reconciled "
                  f"{100 * worst['truth']:.2f}%, high bound {100 * worst['high']:.2f}%, raw {100 * worst['raw']:.2f}%; "
                  f"the high bound at most {100 * worst['above']:+.2f}% above the reconciled figure."]
    return "\n".join(lines) + "\n"


SPREAD_HEADER = """Run-to-run spread of the FSDP2 truth on 2 CPU ranks (issue 37, point 3).

Measured by `python benchmarks/fsdp2_accuracy.py --repeat 3 --only ...` (the runs of `fsdp2_accuracy.md`,
repeated in one launch, without MemWatch), steady step peak (steps 2, 3) of each run.

"""
SPREAD_NOTES = """
The reconciled figure places each free that gloo's worker made unreported at the block's last reader; the high
bound at the latest time the profiler allows (the address's reuse, or the worker's next event:
``hf_memwatch.testing.truth.unreported_frees``). Where the two differ, the worker dropped a collective's buffer
late (it waits for the GIL to release the tensor's Python object) and the live bytes were higher than the
reconciled figure for that long: a real spread of the memory, bounded by the high bound.
"""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[4:], int(sys.argv[3]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fsdp2_accuracy.md")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--keep", type=Path, default=None, help="the launch's folder (default: a temporary one)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each configuration in the launch; > 1 writes the spread to --spread-out only")
    parser.add_argument("--spread-out", type=Path, default=ROOT / "benchmarks" / "results" / "fsdp2_spread.md")
    opts = parser.parse_args()
    names = opts.only or list(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        out = opts.keep or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        launch(out, names, opts.repeat)
        if opts.repeat > 1:
            text = spread(out, names)
            opts.spread_out.write_text(SPREAD_HEADER + text + SPREAD_NOTES)
            print(text)
            return
        text = table(out, names)
    header = (__doc__.split("\n\n")[0] + "\n\n" + "Measured by `python benchmarks/fsdp2_accuracy.py` (2 gloo ranks, "
              "torch 2.13.0 CPU, tiny GPT-2 2 x 128 and Llama 2 x 128, AdamW, 3 steps, without MemWatch).\n\n")
    opts.out.write_text(header + text + NOTES)
    print(text)


if __name__ == "__main__":
    main()
