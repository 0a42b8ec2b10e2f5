"""Launched by ``tests/engines/test_distributed.py`` with ``torchrun --nproc-per-node 2``: real Trainer runs on gloo.

Usage: ``torchrun --nproc-per-node 2 ddp_trainer.py OUT_DIR``. Each rank writes ``facts.rank<N>.json``
into OUT_DIR with what the test checks the timelines against (no assertion here: the test decides).

Runs, each in its own output dir under OUT_DIR:

* ``plain``: DDP, no MemWatch (the loss history monitoring must not change);
* ``watch``: DDP as the Trainer configures it (``gradient_as_bucket_view=False``), MemWatch full,
  under ``torch.profiler`` for the per-rank truth (``hf_memwatch.testing.truth.step_peaks``);
* ``bucket_view``: the same with ``gradient_as_bucket_view=True`` (gradients are the buckets);
* ``auto``: ``MemWatch(auto=True)`` with a budget that fits on rank 0 and not on rank 1, under
  ``torch.profiler`` (the planned run's truth);
* ``auto_fail``: rank 1's budget is below the weights: both ranks must stop with a ``PlanError``;
* ``replan``: both ranks' budget 1.5 x the configured peak (the plan keeps the run as given), and rank 1
  alone holds one more configured peak's worth of memory during step 1 (:class:`RankSpike`): its
  footprint check finds the next step would not fit, and both ranks must switch the same remedy
  before step 2, agreed without a hang (issue 19);
* ``hand``: the ``auto`` run's plan configured by hand, without MemWatch (same losses and grad norms);
* ``ckpt_bnb``: accumulation 2, checkpointing and 8-bit AdamW, 16 tokens on rank 0 and 64 on rank 1,
  MemWatch full, under the profiler (issue 19's planned run, by hand).

Then, on the same process group, ``agreement.py``'s scenarios, ``fsdp2_shards.py``'s FSDP2 step and
``stream_ranks.py``'s stream read ahead on both ranks (their files beside ``facts.rank<N>.json``), and last ``fsdp2_trainer.py``'s FSDP2 runs through the
Trainer (in OUT_DIR/fsdp2_trainer; last because it lets accelerate build FSDP on these CPU ranks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

import torch  # noqa: E402
from conftest import (  # noqa: E402
    freeze_imported_objects,
    gpt2_model,
    loss_history,
    rank_step_peaks,
    rank_timeline,
    token_dataset,
    training_args,
)
from transformers import Trainer, TrainerCallback  # noqa: E402

from hf_memwatch import MemWatch, PlanError  # noqa: E402
from hf_memwatch.engines.ddp.live import ddp_bucket_sizes, find_ddp  # noqa: E402
from hf_memwatch.integration.callback import find_trainer  # noqa: E402
from hf_memwatch.measure.ranks import max_over_ranks, world  # noqa: E402
from hf_memwatch.testing.truth import (  # noqa: E402
    StepMarker,
    cpu_memory_profile,
    remembered_allocations,
    step_peaks,
)


def unique_bytes(tensors) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


class ProfileTraining(TrainerCallback):
    """The profiler's CPU memory truth from ``on_train_begin`` (the model already wrapped) to the end.

    Started here rather than around ``train()``: the move to ``cpu:0`` and DDP's initial broadcast
    free storages the profiler cannot see (freed on gloo's threads), which would offset the running
    sum. The baseline is what is alive at that moment by the engines' own figures: parameters,
    buffers and DDP's gradient buckets (its logging data).

    ``prime`` (:func:`~hf_memwatch.testing.truth.remembered_allocations`, started before the model
    is built) makes the allocator report the frees of blocks allocated before the window: DDP frees
    its initial buckets when it rebuilds them in iteration 2 (gradient checkpointing: no search for
    unused parameters). Without it the truth kept them: +2,361,344 B from step 2 on, the -13.7 to
    -18.9% of issue 19.
    """

    def __init__(self, prime=None) -> None:
        self.prime = prime
        self.prof = cpu_memory_profile()
        self.baseline = 0
        self.step_peaks: list[int] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        trainer = find_trainer()
        ddp = find_ddp(trainer.model_wrapped)
        self.baseline = unique_bytes(list(model.parameters()) + list(model.buffers())) + sum(ddp_bucket_sizes(ddp))
        if self.prime is not None:
            self.prime.stop()
        self.prof.start()

    def on_train_end(self, args, state, control, **kwargs):
        self.prof.stop()
        self.step_peaks = step_peaks(self.prof, self.baseline)


class RankSpike(TrainerCallback):
    """On one rank, during step 1 only, ``nbytes`` held from step begin to step end (a rank-local spike)."""

    def __init__(self, rank: int, nbytes: int) -> None:
        self.rank, self.nbytes, self.held = rank, nbytes, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and world()[0] == self.rank:
            self.held = torch.ones(self.nbytes // 4)

    def on_step_end(self, args, state, control, **kwargs):
        self.held = None


def run(out: Path, name: str, callbacks: list, bucket_view: bool = False, profiled: bool = False,
        plan: dict | None = None, seq_len: int = 32) -> dict:
    prime = remembered_allocations() if profiled else None
    model = gpt2_model()
    plan = plan or {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "activation_checkpointing": False,
                    "optim": "adamw_torch"}
    args = training_args(out / name, ddp_backend="gloo", per_device_train_batch_size=plan["micro_batch_size"],
                         gradient_accumulation_steps=plan["gradient_accumulation_steps"],
                         gradient_checkpointing=plan["activation_checkpointing"], optim=plan["optim"], max_steps=3)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(64, seq_len, 1000),
                      callbacks=callbacks + ([StepMarker()] if profiled else []))
    if bucket_view:  # the Trainer's arguments cannot set it; accelerate's DDP kwargs handler can
        trainer.accelerator.ddp_handler.gradient_as_bucket_view = True
    profiler = ProfileTraining(prime) if profiled else None
    if profiler is not None:
        trainer.add_callback(profiler)
    trainer.train()
    ddp = find_ddp(trainer.model_wrapped)
    return {
        "truth_step_peaks": profiler.step_peaks if profiler is not None else None,
        "losses": loss_history(trainer),
        "grad_norms": [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry],
        "param_bytes": unique_bytes(p for p in model.parameters() if p.requires_grad),
        "bucket_sizes": ddp_bucket_sizes(ddp) if ddp is not None else None,
        "ddp": ddp is not None,
        "configured": {
            "micro_batch_size": trainer.args.per_device_train_batch_size,
            "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
            "activation_checkpointing": bool(trainer.args.gradient_checkpointing),
            "optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
        },
    }


def main() -> None:
    freeze_imported_objects()
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    facts: dict = {}
    facts["plain"] = run(out, "plain", [])
    facts["watch"] = run(out, "watch", [MemWatch(detail="full", report=False, summary=False)], profiled=True)
    facts["bucket_view"] = run(out, "bucket_view", [MemWatch(detail="full", report=False, summary=False)], True)
    rank, world_size = world()
    facts["world"] = [rank, world_size]
    # The step peak of the configured run, the same on both ranks; rank 1 gets 0.7 of it as budget (issue 19).
    peak = max(rank_step_peaks(out / "watch", rank))
    facts["max_peak_over_ranks"] = max_over_ranks(peak)
    budget = 8 * 2**30 if rank == 0 else int(0.7 * peak)
    facts["auto_budget"] = budget
    facts["auto"] = run(out, "auto", [MemWatch(auto=True, budget=budget, report=False, summary=False)],
                        profiled=True)
    agreed = [r for r in rank_timeline(out / "auto", rank) if r["event"] == "plan"][-1]
    facts["hand"] = run(out, "hand", [], plan={k: agreed[k] for k in ("micro_batch_size", "gradient_accumulation_steps",
                                                                       "activation_checkpointing", "optim")})
    # Issue 19's planned run, configured by hand: accumulation 2, checkpointing, 8-bit AdamW, ranks
    # with 16 and 64 tokens (MemWatch's step peaks were -19...+14% off the profiler's).
    facts["ckpt_bnb"] = run(out, "ckpt_bnb", [MemWatch(detail="full", report=False, summary=False)], profiled=True,
                            plan={"micro_batch_size": 4, "gradient_accumulation_steps": 2,
                                  "activation_checkpointing": True, "optim": "adamw_bnb_8bit"},
                            seq_len=16 if rank == 0 else 64)
    facts["replan_budget"] = int(1.5 * facts["max_peak_over_ranks"])
    facts["replan"] = run(out, "replan", [MemWatch(auto=True, budget=facts["replan_budget"], report=False, summary=False),
                                          RankSpike(1, facts["max_peak_over_ranks"])])
    # Rank 1's budget is below the weights alone: it cannot plan, and rank 0 must not wait for it.
    try:
        budget = 8 * 2**30 if rank == 0 else 2**20
        run(out, "auto_fail", [MemWatch(auto=True, budget=budget, report=False, summary=False)])
        facts["auto_fail"] = {"raised": None}
    except PlanError as exc:
        facts["auto_fail"] = {"raised": type(exc).__name__, "message": str(exc)}
    (out / f"facts.rank{rank}.json").write_text(json.dumps(facts))
    # The scripts beside this one, on this launch's process group (a launch each cost ~12 s of imports).
    from agreement import scenarios
    from fsdp2_shards import shards
    from fsdp2_trainer import runs as fsdp2_runs
    from stream_ranks import runs as stream_runs

    scenarios(out)
    shards(out)
    stream_runs(out)
    fsdp2_runs(out / "fsdp2_trainer")  # FSDP2 through the Trainer, last: it changes accelerate's state
    # Tear gloo down before interpreter exit: left to atexit, its threads can abort the process
    # ("terminate called without an active exception", seen intermittently).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
