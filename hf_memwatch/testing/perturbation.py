"""The same run with and without MemWatch, measured by PyTorch: does watching change the bytes?

A :class:`Case` builds a fresh ``Trainer`` (same seed, same data) for a given output folder and
callbacks. :func:`compare` trains it twice under the profiler (:mod:`hf_memwatch.testing.truth`):
once plain, once with ``MemWatch`` attached, and returns both window peaks, the profiler's step
peaks of the watched run, MemWatch's own step peaks from its timeline and, on request, the
estimate. Used by ``tests/test_perturbation.py`` and ``benchmarks/perturbation.py``.

Usage:
    >>> result = compare(CASES["orpo"], "orpo")           # doctest: +SKIP
    >>> result.perturbation                                # (with - without) / without  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.records import StepRecord
from ..core.timeline import read_records
from ..measure.attribution import weight_storages
from .estimate_truth import ListDataset, synthetic_dataset
from .families import FAMILIES, build_family_model
from .truth import StepMarker, cpu_memory_profile, step_peaks, window_peak

Builder = Callable[[str, list[Any]], Any]  # (output_dir, callbacks) -> Trainer


@dataclass(frozen=True)
class Comparison:
    """Peaks in bytes of one case; ``live`` are MemWatch's step peaks, ``truth`` the profiler's."""

    name: str
    without: int | None
    watched: int
    truth: list[int]
    live: list[int]
    estimate: int | None = None
    losses: tuple[list[float], list[float]] = ([], [])  # unwatched, watched
    branches: dict[str, int] | None = None  # the estimate's branches (MemoryEstimate.branches), by name

    @property
    def perturbation(self) -> float:
        """Relative change of the profiler's peak when MemWatch is attached."""
        assert self.without is not None, "compared without the unwatched run"
        return (self.watched - self.without) / self.without

    @property
    def live_error(self) -> float:
        """Worst relative gap between MemWatch's step peaks and the profiler's."""
        return max(abs(a - b) / b for a, b in zip(self.live, self.truth))

    @property
    def estimate_error(self) -> float | None:
        """Estimate against the unwatched run's peak."""
        if self.estimate is None or self.without is None:
            return None
        return (self.estimate - self.without) / self.without


def _baseline(trainer: Any) -> int:
    models = [trainer.model] + [getattr(trainer, name) for name in ("ref_model", "teacher_model") if getattr(trainer, name, None)]
    return sum(sum(weight_storages(model, None).values()) for model in models)


def _profiled(trainer: Any) -> tuple[int, list[int], list[float]]:
    baseline = _baseline(trainer)
    with cpu_memory_profile() as prof:
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return window_peak(prof, baseline), step_peaks(prof, baseline), losses


def compare(build: Builder, name: str = "", *, unwatched: bool = True, with_estimate: bool = False) -> Comparison:
    """Train ``build``'s Trainer unwatched (unless ``unwatched=False``), then watched
    (``MemWatch(detail="full")``); the profiler's peaks of both, MemWatch's own and the estimate's."""
    from ..integration.callback import MemWatch

    with tempfile.TemporaryDirectory() as plain_dir, tempfile.TemporaryDirectory() as watched_dir, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        without, plain_losses = None, []
        if unwatched:
            without, _, plain_losses = _profiled(build(plain_dir, [StepMarker()]))
        trainer = build(watched_dir, [StepMarker(), MemWatch(detail="full", report=False, summary=False)])
        predicted, branches = None, None
        if with_estimate:
            from ..estimation.estimate import estimate

            result = estimate(trainer)
            predicted, branches = result.peak_bytes, dict(result.branches)
        watched, truth, losses = _profiled(trainer)
        records = read_records(Path(watched_dir) / "memwatch" / "timeline.jsonl")
        live = [r.peak for r in records if isinstance(r, StepRecord)]
    return Comparison(name, without, watched, truth, live, predicted, (plain_losses, losses), branches)


# -- cases ------------------------------------------------------------------------------------------

def _args(out: str, config_class: Any = None, **extra: Any) -> Any:
    from transformers import TrainingArguments

    common = dict(output_dir=out, per_device_train_batch_size=4, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    return (config_class or TrainingArguments)(**{**common, **extra})


def _trainer(model: Any, dataset: Any, **extra: Any) -> Builder:
    def build(out: str, callbacks: list[Any]) -> Any:
        from transformers import Trainer

        return Trainer(model=model(), args=_args(out, **extra), train_dataset=dataset(), callbacks=callbacks)

    return build


def family_case(name: str, batch: int = 2, seq_len: int = 64) -> Builder:
    """A family of :mod:`~hf_memwatch.testing.families`, 2 fp32 steps of ``batch`` x ``seq_len``."""
    task = FAMILIES[name][0]

    def dataset() -> Any:
        return synthetic_dataset(FAMILIES[name][1](), task, batch * 2, seq_len, seq_len)

    return _trainer(lambda: build_family_model(name), dataset, per_device_train_batch_size=batch)


def mamba_case() -> Builder:
    """Mamba's slow path (no ``mamba_ssm`` kernels): a sequential scan in plain PyTorch."""
    def model() -> Any:
        import transformers

        torch.manual_seed(0)
        config = transformers.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=1000, state_size=8)
        return transformers.MambaForCausalLM(config)

    return _trainer(model, lambda: synthetic_dataset(model().config, "causal-lm", 8, 32, 32))


def vit_case() -> Builder:
    """Image classification: the dataloader forms ``pixel_values`` + ``labels`` batches."""
    def model() -> Any:
        import transformers

        torch.manual_seed(0)
        config = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, image_size=64, patch_size=8, num_labels=10)
        return transformers.ViTForImageClassification(config)

    def dataset() -> Any:
        generator = torch.Generator().manual_seed(0)
        return ListDataset([{"pixel_values": torch.randn(3, 64, 64, generator=generator),
                             "labels": torch.tensor(i % 10)} for i in range(8)])

    return _trainer(model, dataset)


def whisper_case() -> Builder:
    """Speech to text: log-mel ``input_features`` + token ``labels``."""
    def model() -> Any:
        import transformers

        torch.manual_seed(0)
        config = transformers.WhisperConfig(
            d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=150,
            max_target_positions=64, vocab_size=1000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=1)
        return transformers.WhisperForConditionalGeneration(config)

    def dataset() -> Any:
        generator = torch.Generator().manual_seed(0)
        return ListDataset([{"input_features": torch.randn(80, 300, generator=generator),
                             "labels": torch.randint(3, 1000, (8,), generator=generator)} for _ in range(8)])

    return _trainer(model, dataset)


def preference_case(kind: str) -> Builder:
    """TRL's ORPO or CPO (``trl.experimental``) on a tiny Llama, fp32: TRL's ``selective_log_softmax``."""
    def build(out: str, callbacks: list[Any]) -> Any:
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
        from datasets import Dataset
        from transformers import LlamaConfig, LlamaForCausalLM

        from .tokenizers import word_tokenizer

        if kind == "orpo":
            from trl.experimental.orpo import ORPOConfig as Config
            from trl.experimental.orpo import ORPOTrainer as Trainer
        else:
            from trl.experimental.cpo import CPOConfig as Config
            from trl.experimental.cpo import CPOTrainer as Trainer
        generator = torch.Generator().manual_seed(0)

        def words(n: int) -> str:
            return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))

        data = Dataset.from_list([{"prompt": words(12), "chosen": words(12), "rejected": words(12)}
                                  for _ in range(8)])
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=1002, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001))
        args = _args(out, Config, max_length=64)
        return Trainer(model=model, args=args, train_dataset=data, processing_class=word_tokenizer(),
                       callbacks=callbacks)

    return build


CASES: dict[str, Builder] = {
    "orpo": preference_case("orpo"),
    "cpo": preference_case("cpo"),
    "mamba": mamba_case(),
    "vit": vit_case(),
    "whisper": whisper_case(),
}
