"""Ground truth for the estimator: the peak of a real ``Trainer.train()`` on the CPU, from PyTorch.

Used by ``benchmarks/accuracy.py`` and the tests. The model's parameter and buffer storages live
before ``train()`` are the baseline; the profiler's CPU allocator events inside ``train()`` give
the rest (:func:`hf_memwatch.testing.truth.window_peak`).

Usage:
    >>> peak = trainer_peak(model, task="causal-lm", micro_batch_size=8, seq_len=64)   # doctest: +SKIP
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch

from ..compat.accelerate import accelerate_environment_kept
from ..compat.trainer import checkpointing_argument
from ..core.renamed import renamed_keywords
from ..estimation.generation import GenerationSettings
from ..estimation.trainer_mirror import make_batch
from ..measure.attribution import weight_storages
from .truth import cpu_memory_profile, window_peak


class ListDataset(torch.utils.data.Dataset):
    """A list of examples (dicts of tensors) as a map-style dataset."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


def synthetic_dataset(config: Any, task: str, rows: int, seq_len: int, target_len: int) -> ListDataset:
    """``rows`` examples shaped as :func:`~hf_memwatch.estimation.trainer_mirror.make_batch` shapes one batch."""
    batch = make_batch(config, task, rows, seq_len, target_len, "cpu")
    return ListDataset([{k: v[i] for k, v in batch.items()} for i in range(rows)])


def _fresh_bitsandbytes_overrides() -> None:
    """Forget per-parameter overrides earlier Trainers left in bitsandbytes' process-wide manager.

    ``Trainer.create_optimizer`` registers 32-bit states for embeddings there, and the manager keys
    them by (group, index) for every later optimizer too: without this, each measured run would
    depend on the runs before it in the same process, unlike a fresh training process.
    """
    import sys

    bnb = sys.modules.get("bitsandbytes")
    if bnb is not None:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


def trainer_peak(
    model: torch.nn.Module, *, task: str, seq_len: int, micro_batch_size: int | None = None,
    target_len: int | None = None, precision: str = "fp32", optim: str = "adamw_torch",
    activation_checkpointing: bool = False, gradient_accumulation_steps: int = 1, max_grad_norm: float = 1.0,
    steps: int = 2, **renamed: Any,
) -> int:
    """Peak live CPU bytes of ``steps`` real Trainer optimizer steps, from the profiler's memory events
    (named as :func:`hf_memwatch.estimate`: the old ``batch_size``/``accum``/``checkpointing`` warned)."""
    from transformers import Trainer, TrainingArguments

    old = renamed_keywords("trainer_peak", renamed)  # the old batch_size/accum/checkpointing, warned
    batch_size = old.pop("micro_batch_size", micro_batch_size)
    accum = old.pop("gradient_accumulation_steps", gradient_accumulation_steps)
    checkpointing = old.pop("activation_checkpointing", activation_checkpointing)
    if old or batch_size is None:
        raise TypeError(f"trainer_peak() needs micro_batch_size; unexpected keywords {sorted(old)}")
    config = model.config
    target_len = target_len or seq_len
    dataset = synthetic_dataset(config, task, batch_size * accum * steps, seq_len, target_len)
    # transformers 4.x leaves a bf16 run's precision in the environment for the next Trainer (compat.accelerate)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), accelerate_environment_kept():
        warnings.simplefilter("ignore")
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accum,
            max_steps=steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
            bf16=precision == "bf16", fp16=precision == "fp16", optim=optim, max_grad_norm=max_grad_norm,
            **{checkpointing_argument(): checkpointing}, disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset)
        _fresh_bitsandbytes_overrides()
        baseline = sum(weight_storages(model, None).values())
        with cpu_memory_profile() as prof:  # collects earlier runs' garbage first
            trainer.train()
    return window_peak(prof, baseline)


def _no_metrics(prediction: Any) -> dict[str, float]:
    """A ``compute_metrics`` that makes the Trainer gather predictions and labels, computing nothing."""
    return {}


def evaluate_peak(
    model: torch.nn.Module, *, task: str, batch_size: int, samples: int, seq_len: int,
    target_len: int | None = None, accumulation_steps: int | None = None, prediction_loss_only: bool = False,
    precision: str = "fp32", generation: GenerationSettings | None = None,
) -> int:
    """Peak live CPU bytes of one real ``Trainer.evaluate()`` (``compute_metrics`` set), from the profiler.

    The model's storages are the baseline; no training ran, so no optimizer state is live.
    With ``generation``: a ``Seq2SeqTrainer`` with ``predict_with_generate`` and those settings, run
    to the estimate's worst case — the model's ``eos_token_id`` unset for the run, so every sequence
    is generated to the max length, and no pad token in the inputs (unpadded prompts).
    """
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    config = model.config
    dataset = synthetic_dataset(config, task, samples, seq_len, target_len or seq_len)
    common: dict[str, Any] = dict(
        per_device_eval_batch_size=batch_size, eval_accumulation_steps=accumulation_steps,
        prediction_loss_only=prediction_loss_only, report_to=[], use_cpu=True,
        bf16=precision == "bf16", fp16=precision == "fp16", disable_tqdm=True, dataloader_num_workers=0,
    )
    eos_token_id = getattr(model.generation_config, "eos_token_id", None) if generation is not None else None
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), accelerate_environment_kept():
        warnings.simplefilter("ignore")
        if generation is None:
            trainer = Trainer(model=model, args=TrainingArguments(output_dir=tmp, **common), eval_dataset=dataset,
                              compute_metrics=_no_metrics)
        else:
            _unpadded(dataset, int(config.pad_token_id))
            args = Seq2SeqTrainingArguments(
                output_dir=tmp, predict_with_generate=True, generation_max_length=generation.max_length,
                generation_num_beams=generation.num_beams, **common)
            trainer = Seq2SeqTrainer(model=model, args=args, eval_dataset=dataset, compute_metrics=_no_metrics)
            model.generation_config.eos_token_id = None  # no EOS: every sequence to the max length
        baseline = sum(weight_storages(model, None).values())
        with cpu_memory_profile() as prof:
            try:
                trainer.evaluate()
            finally:  # the caller's model keeps its EOS
                if generation is not None:
                    model.generation_config.eos_token_id = eos_token_id
    return window_peak(prof, baseline)


def _unpadded(dataset: ListDataset, pad_token_id: int) -> None:
    """Replace the pad id in the inputs (random ids hit it): prompts are full rows, as the estimate's are."""
    for row in dataset.rows:
        ids = row["input_ids"]
        ids[ids == pad_token_id] = pad_token_id + 1
