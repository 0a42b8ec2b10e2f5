"""A token stream read ahead on two DDP ranks (issue 37, point 4), run by ``ddp_trainer.py`` on its process group.

GPT-2 with 2,048 positions fed an ``IterableDataset`` of 16-token samples, then 256-token ones from step 11 on
(accelerate's dispatcher: rank 0 reads every rank's micro-batches from its copy of the stream). Planned for the
2,048 positions nothing fits the budget; each rank reads its copy's first samples ahead and the run is planned
on them. Rank 0 reads the first long sample while training; the ranks agree on it after a step and predict
the plan again on it on both ranks: checkpointing turned on (``checkpointing``) or both ranks stopping before
step 11 (``stop``); ``workers``: the stream read by a dataloader worker (each rank plans on a copy's first
samples, and the ranks agree on the longest micro-batch fetched, before its step); ``plain``: the same stream
without MemWatch. Each rank writes ``stream.rank<N>.json`` (the test asserts on it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

import torch  # noqa: E402
from conftest import gpt2_model, loss_history, rank_timeline, token_dataset, training_args  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback  # noqa: E402

from hf_memwatch import MemWatch, estimate  # noqa: E402
from hf_memwatch.measure.ranks import world  # noqa: E402
from hf_memwatch.planning.predict import ESTIMATE_MARGIN  # noqa: E402

BATCH, SHORT, LONG, SHORT_STEPS, STEPS = 2, 16, 256, 10, 12


class Tokens(torch.utils.data.IterableDataset):
    """Token samples of the given lengths from the stream's own generator (the same on every rank)."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __iter__(self):
        generator = torch.Generator().manual_seed(0)
        for length in self.lengths:
            ids = torch.randint(0, 1000, (length,), generator=generator)
            yield {"input_ids": ids, "labels": ids.clone()}


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def model() -> GPT2LMHeadModel:
    config = gpt2_model(n_embd=64).config
    config.n_positions = 2048  # the bound the stream is first planned for: nothing fits at it
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


class Steps(TrainerCallback):
    """Per step: whether activation checkpointing was on as it began, and the lengths its forwards ran on."""

    def __init__(self) -> None:
        self.checkpointing: list[bool] = []
        self.lengths: list[list[int]] = []
        self.trainer: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.checkpointing.append(bool(self.trainer.model.is_activation_checkpointing))
        self.lengths.append([])

    def record(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        from torch._subclasses.fake_tensor import FakeTensor

        ids = kwargs.get("input_ids")
        if module.training and self.lengths and ids is not None and not isinstance(ids, FakeTensor):
            self.lengths[-1].append(int(ids.shape[1]))


def budgets(out: Path) -> tuple[int, int, int]:
    """(the short stream's predicted peak, the long batch's with and without checkpointing), margin included,
    on this rank of the DDP run."""
    def peak(length: int, checkpointing: bool) -> int:
        trainer = Trainer(model=model(), train_dataset=token_dataset(8, length, 1000), data_collator=collate,
                          args=training_args(out / "est", ddp_backend="gloo", per_device_train_batch_size=BATCH))
        return int(estimate(trainer, activation_checkpointing=checkpointing).peak_bytes * (1 + ESTIMATE_MARGIN)) + 1

    return peak(SHORT, False), peak(LONG, True), peak(LONG, False)


def run(out: Path, budget: int | None, workers: int = 0) -> dict[str, Any]:
    """The stream trained with ``MemWatch(auto=True, budget=budget)`` (None: without MemWatch), read by
    ``workers`` dataloader workers."""
    steps = Steps()
    data = Tokens([SHORT] * (SHORT_STEPS * BATCH * 2) + [LONG] * ((STEPS - SHORT_STEPS) * BATCH * 2))
    watch = [] if budget is None else [MemWatch(auto=True, budget=budget, report=False, summary=False)]
    trainer = Trainer(model=model(), train_dataset=data, data_collator=collate,
                      args=training_args(out, ddp_backend="gloo", per_device_train_batch_size=BATCH,
                                         max_steps=STEPS, dataloader_num_workers=workers), callbacks=[steps, *watch])
    steps.trainer = trainer
    trainer.model.register_forward_pre_hook(steps.record, with_kwargs=True)
    try:
        trainer.train()
        raised = None
    except Exception as exc:  # noqa: BLE001 - recorded: the test says what it expected
        raised = f"{type(exc).__name__}: {exc}"
    return {"raised": raised, "global_step": trainer.state.global_step, "checkpointing": steps.checkpointing,
            "lengths": steps.lengths, "dataset": type(trainer.train_dataset).__name__,
            "losses": loss_history(trainer),
            "plans": [] if budget is None or raised is not None  # a stop before training may leave no timeline
            else [r for r in rank_timeline(out, world()[0]) if r["event"] == "plan"]}


def runs(out: Path) -> None:
    """Both cases on the default process group; ``stream.rank<N>.json`` into ``out``."""
    rank, _ = world()
    short, checkpointed, plain = budgets(out)
    facts: dict[str, Any] = {"budgets": [short, checkpointed, plain], "plain": run(out / "stream_plain", None)}
    for case, budget in (("checkpointing", (checkpointed + plain) // 2), ("stop", (short + checkpointed) // 2)):
        facts[case] = {"budget": budget, **run(out / f"stream_{case}", budget)}
    budget = (checkpointed + plain) // 2  # read by a dataloader worker: planned on a copy, measured as fetched
    facts["workers"] = {"budget": budget, **run(out / "stream_workers", budget, workers=1)}
    (out / f"stream.rank{rank}.json").write_text(json.dumps(facts))


def main() -> None:
    torch.distributed.init_process_group("gloo")
    runs(Path(sys.argv[1]))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
