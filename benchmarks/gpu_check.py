"""GPU truth: one command that checks every CUDA claim of hf-memwatch on a real GPU (issues 8 and 23).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu                 # make gpu-check
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/dry          # the dry run (make test)

Four checks, on real ``Trainer`` runs of models built from configs (random weights, no hub):

* **attribution** — the five live classes sum to the device's allocated bytes at every snapshot,
  read by a callback at the same instants on the module MemWatch hooks; each step's peak equals the
  device's peak over that step, and an unmonitored twin run (peaks reset the same way: at every step
  begin) agrees within 1%.
* **prediction** — ``estimate(..., device=...)`` against the measured peaks: allocated
  (``max_memory_allocated``), reserved (``max_memory_reserved``, the caching allocator replayed by
  :mod:`hf_memwatch.estimation.cuda_allocator`) and the device's used memory (``mem_get_info``, the
  estimate's ``device_bytes``). >= 1B-parameter shapes first (a Llama-3.2-1B-like and a
  Qwen3-1.7B-like config at 2k-8k tokens, bf16, SDPA, fused AdamW and 8-bit AdamW, with and without
  checkpointing, one QLoRA case), then smaller ones. Goals: allocated median |error| <= 3 %, worst
  <= 8 %; reserved worst <= 10 %.
* **prevention** — a limit below what the configured batch needs (CUDA:
  ``set_per_process_memory_fraction``): ``MemWatch(auto=True)`` must finish with 0 OOM, and the auto
  plan's predicted reserved bytes must match the measured ``max_memory_reserved`` within 10 % and
  stay inside the limit. The Trainer's ``auto_find_batch_size`` is reported for comparison.
* **overhead** — steady-state seconds per step with ``MemWatch(report=False)`` vs without, runs
  interleaved, ratio of medians (no background picture process during timing). Goal <= 1.01.

``--device cpu`` runs the same checks through the same code — same Trainer runs, same comparisons —
with the CPU backend's figures (a :class:`~hf_memwatch.measure.tracker.StorageTracker` over the run)
in place of the allocator's; what only CUDA has (reserved bytes, ``mem_get_info``, ``num_ooms``, the
per-process fraction, ``auto_find_batch_size``'s OOM retries) is skipped and listed in the JSON's
``skipped``. ``--quick`` replaces every shape by a tiny one.

Results as they come: ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` are rewritten atomically
(temporary file + ``os.replace``) after every check and every configuration of the prediction sweep,
so a run killed at any moment leaves valid JSON of what finished (``status: "running"`` until the
end). Each check gets a share of ``--time-budget-s`` (default 420 s, under 8 minutes with start-up)
and bounds itself by it: configurations or rounds that would not fit are dropped and listed. Exit 1
when a check fails. With ``--device cuda`` on a machine without CUDA: one line, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import sys
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NO_CUDA_MESSAGE = "gpu-check: no CUDA device here (torch.cuda.is_available() is False); no check was run."
CHECK_NAMES = ("attribution", "prediction", "prevention", "overhead")
# Share of the time budget each check may use (what one leaves goes to the next ones).
CHECK_SHARES = {"attribution": 0.12, "prediction": 0.58, "prevention": 0.18, "overhead": 0.12}
DEFAULT_BUDGET_S = 420.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (standard library only: it is read before anything heavy is imported)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--checks", default=",".join(CHECK_NAMES),
                        help=f"comma-separated subset of {', '.join(CHECK_NAMES)}")
    parser.add_argument("--time-budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"total seconds for the checks, each bounded by its share (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default) or cpu: the dry run, the CPU backend's figures for the allocator's")
    parser.add_argument("--quick", action="store_true", help="tiny shapes everywhere (the dry run)")
    args = parser.parse_args(argv)
    args.checks = [n.strip() for n in args.checks.split(",") if n.strip()]
    unknown = [n for n in args.checks if n not in CHECK_NAMES]
    if unknown:
        parser.error(f"unknown check(s): {', '.join(unknown)}")
    return args


def exit_if_no_cuda(argv: Sequence[str] | None) -> None:
    """CUDA asked for and absent: validate the command line, say so in one line, exit 0 (CPU CI)."""
    args = parse_args(argv)
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        sys.exit(0)


if __name__ == "__main__":  # before transformers is imported: a CPU machine answers at once
    exit_if_no_cuda(sys.argv[1:])

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hf_memwatch import MemWatch  # noqa: E402
from hf_memwatch.core.timeline import read_timeline  # noqa: E402
from hf_memwatch.estimation.estimate import estimate  # noqa: E402
from hf_memwatch.integration.compiled import hook_target  # noqa: E402
from hf_memwatch.measure.tracker import StorageTracker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when loaded by path
from gpu_check_report import (  # noqa: E402
    GOALS,
    CheckResult,
    Config,
    ResultsFile,
    attribution_verdict,
    configurations,
    error_stats,
    interleaved,
    overhead_ratio,
    prevention_verdict,
    relative_error,
    verdict_word,
    write_results,  # noqa: F401 - re-exported: the script's API in one module
)

PHASE_EVENTS = ("step_begin", "after_forward", "after_backward", "after_optimizer", "step_end")


# -- the device's figures -----------------------------------------------------------------------
class Probe:
    """The figures of the memory the checks read: allocated, its peak, reserved, OOMs, device used.

    :class:`CudaProbe` reads the caching allocator; :class:`CpuProbe` the CPU backend's figures.
    ``shares_memwatch_peak``: MemWatch resets this very peak counter at each snapshot (CUDA).
    """

    kind = "none"
    shares_memwatch_peak = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def session(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """Around one training run (the CPU counts storages inside it)."""
        return contextlib.nullcontext()

    def allocated(self) -> int: raise NotImplementedError
    def peak(self) -> int: raise NotImplementedError
    def reset_peak(self) -> None: raise NotImplementedError
    def reserved(self) -> int | None: return None
    def peak_reserved(self) -> int | None: return None
    def num_ooms(self) -> int | None: return None
    def num_alloc_retries(self) -> int | None: return None
    def device_used(self) -> int | None: return None
    def total_memory(self) -> int | None: return None
    def synchronize(self) -> None: pass

    def free(self) -> None:
        """Drop what earlier runs left (the caching allocator's cache on CUDA), so each run starts alike."""
        gc.collect()


class CudaProbe(Probe):
    kind = "cuda"
    shares_memwatch_peak = True

    def allocated(self) -> int: return torch.cuda.memory_allocated(self.device)
    def peak(self) -> int: return torch.cuda.max_memory_allocated(self.device)
    def reset_peak(self) -> None: torch.cuda.reset_peak_memory_stats(self.device)
    def reserved(self) -> int | None: return torch.cuda.memory_reserved(self.device)
    def peak_reserved(self) -> int | None: return torch.cuda.max_memory_reserved(self.device)
    def num_ooms(self) -> int | None: return torch.cuda.memory_stats(self.device).get("num_ooms", 0)
    def num_alloc_retries(self) -> int | None: return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
    def total_memory(self) -> int | None: return torch.cuda.mem_get_info(self.device)[1]
    def synchronize(self) -> None: torch.cuda.synchronize(self.device)

    def device_used(self) -> int | None:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def free(self) -> None:
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


class RunTracker(StorageTracker):
    """A :class:`StorageTracker` that leaves out the storages alive before the run (but the weights).

    A view allocates nothing, yet a tracker counts the storage of every tensor an operator returns:
    the dataloader's ``dataset[i]`` (a ``select`` of the dataset's tensor) would count the whole
    dataset as allocated in the run. Measured on the dry run's attribution check against the
    profiler's ``[memory]`` events: +2,048 B at every snapshot, the 8 x 32 int64 token table. What
    PyTorch's CPU allocator counts is the weights plus what the run allocates (the project's truth,
    :mod:`hf_memwatch.testing.truth`), so storages reachable before the run are ignored.
    """

    def __init__(self, weights: list[torch.Tensor]) -> None:
        super().__init__("cpu")
        gc.collect()
        own = {t.untyped_storage()._cdata for t in weights}
        self._before: dict[int, weakref.ref] = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                with contextlib.suppress(RuntimeError):  # tensors without storage (sparse, functional)
                    storage = obj.untyped_storage()
                    if storage._cdata not in own:
                        self._before[storage._cdata] = weakref.ref(storage)
        self.register(weights)

    def _track_plain(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu" and self._before:
            ref = self._before.get(tensor.untyped_storage()._cdata)
            if ref is not None and ref() is not None:  # alive since before the run (a freed key is reused)
                return
        super()._track_plain(tensor)


class CpuProbe(Probe):
    """The CPU backend's figures: a :class:`RunTracker` entered around each run, weights registered."""

    kind = "cpu"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.tracker: StorageTracker = StorageTracker("cpu")

    @contextlib.contextmanager
    def session(self, model: Any) -> Iterator[None]:
        self.tracker = RunTracker(list(model.parameters()) + list(model.buffers()))
        with self.tracker:
            yield

    def allocated(self) -> int: return self.tracker.allocated
    def peak(self) -> int: return max(self.tracker.peak, self.tracker.allocated)
    def reset_peak(self) -> None: self.tracker.reset_peak()


CUDA_ONLY = {  # what the CPU dry run cannot do, and why (listed in the JSON's "skipped")
    "reserved": "the CPU allocator keeps no reserve (max_memory_reserved is CUDA's caching allocator)",
    "mem_get_info": "torch.cuda.mem_get_info: the device's used memory and the CUDA context are CUDA's",
    "num_ooms": "memory_stats()['num_ooms'] is counted by CUDA's caching allocator only",
    "fraction": "torch.cuda.set_per_process_memory_fraction limits CUDA's allocator only: the CPU run gets budget= "
                "the same bytes instead",
    "auto_find_batch_size": "its retries are triggered by CUDA out-of-memory errors; the CPU does not raise one",
    "overhead_goal": "CPU steps are tracked operator by operator: a CPU ratio says nothing of CUDA's, it is reported "
                     "only",
}


CPU_BLIND = {  # where the CPU backend's figures are not a truth to compare with
    "bnb": "bitsandbytes' CPU optimizer kernels allocate their temporaries inside one operator, where the CPU "
           "backend's tracker does not see them (the estimate counts them): compared, not counted on the CPU",
}


# -- time -----------------------------------------------------------------------------------------
@dataclass
class Context:
    """What a check is given: the probe, a scratch folder, its deadline and where results go."""

    probe: Probe
    workdir: str
    quick: bool
    deadline: float  # time.perf_counter() by which the check must end
    results: ResultsFile

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def fits(self, seconds: float) -> bool:
        """Whether ``seconds`` more (with 10 % slack) end before the deadline."""
        return 1.1 * seconds <= self.left()

    def skip(self, check: str, what: str, why: str) -> None:
        self.results.skip(check, what, why)

    @property
    def cuda(self) -> bool:
        return self.probe.kind == "cuda"


def check_deadline(started: float, total_s: float, name: str, remaining_names: Sequence[str]) -> float:
    """This check's deadline: its share of the time left among the checks still to run (what an
    earlier check left unused goes to the later ones)."""
    left = max(0.0, started + total_s - time.perf_counter())
    shares = sum(CHECK_SHARES[n] for n in remaining_names)
    return time.perf_counter() + left * CHECK_SHARES[name] / shares


# -- models and runs ----------------------------------------------------------------------------
def model_config(arch: str, tiny: bool = False) -> Any:
    """The ``PretrainedConfig`` of ``arch`` (SDPA attention); ``tiny`` for the dry run."""
    if arch in ("llama-1b", "qwen3-1.7b") and tiny:
        cls = transformers.Qwen3Config if arch.startswith("qwen") else transformers.LlamaConfig
        config = cls(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     tie_word_embeddings=True)
    elif arch == "llama-1b":  # Llama-3.2-1B's shape: 1.24 B parameters
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                          num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                          head_dim=64, max_position_embeddings=8192, rope_theta=500000.0,
                                          tie_word_embeddings=True)
    elif arch == "qwen3-1.7b":  # Qwen3-1.7B's shape: 1.72 B parameters
        config = transformers.Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True)
    elif arch == "gpt2":
        config = transformers.GPT2Config(n_layer=2 if tiny else 12, n_embd=64 if tiny else 768,
                                         n_head=4 if tiny else 12, vocab_size=1000 if tiny else 50257,
                                         n_positions=1024)
    elif arch == "bert":
        hidden = 64 if tiny else 768
        config = transformers.BertConfig(vocab_size=1000 if tiny else 30522, hidden_size=hidden,
                                         num_hidden_layers=2 if tiny else 12, num_attention_heads=4 if tiny else 12,
                                         intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=2)
    elif arch == "llama":
        config = transformers.LlamaConfig(vocab_size=1000 if tiny else 32000, hidden_size=64 if tiny else 1024,
                                          intermediate_size=172 if tiny else 2816, num_hidden_layers=2 if tiny else 8,
                                          num_attention_heads=4 if tiny else 16, num_key_value_heads=2 if tiny else 8,
                                          max_position_embeddings=2048)
    else:
        raise ValueError(f"unknown architecture {arch!r}")
    config._attn_implementation = "sdpa"
    return config


def task_of(arch: str) -> str:
    return "seq-cls" if arch == "bert" else "causal-lm"


def build_model(arch: str, tiny: bool = False, device: Any = "cpu") -> Any:
    """A model of ``arch`` from its config with random weights, initialised on ``device`` (fast on a GPU)."""
    torch.manual_seed(0)
    config = model_config(arch, tiny)
    auto = (transformers.AutoModelForSequenceClassification if task_of(arch) == "seq-cls"
            else transformers.AutoModelForCausalLM)
    with torch.device(device):
        return auto.from_config(config)


def build_qlora_model(arch: str, tiny: bool, device: Any, workdir: str) -> tuple[Any, Any, Any]:
    """QLoRA as users build it: base saved, loaded 4-bit (nf4, bf16 compute), prepared, LoRA r=16 on all linears.

    Returns the model and the (quantization, lora) specs the estimate takes.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    from hf_memwatch.estimation.peft import LoraSpec
    from hf_memwatch.estimation.quantized import QuantSpec

    quant = QuantSpec(bits=4, quant_type="nf4", compute_dtype="bf16")
    lora = LoraSpec(r=16, alpha=32, targets="all-linear")
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        build_model(arch, tiny, device).to(torch.bfloat16).save_pretrained(tmp)
        base = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=quant.bnb_config(), device_map={"": str(device)}, attn_implementation="sdpa")
    base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    return get_peft_model(base, lora.peft_config("causal-lm")), quant, lora


class TokenDataset:
    """Random token sequences: LM labels copy the inputs, classification draws a class."""

    def __init__(self, n: int, seq_len: int, vocab: int, classification: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen) if classification else self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def dataset_for(model: Any, batch: int, seq_len: int, steps: int) -> TokenDataset:
    classification = type(model).__name__.endswith("ForSequenceClassification")
    return TokenDataset(batch * steps, seq_len, model.config.vocab_size, classification)


def training_args(output_dir: str, *, batch: int, steps: int, device: str, **overrides: Any) -> Any:
    """``TrainingArguments`` of every run here: no saving, no reporting, quiet."""
    values: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=batch, max_steps=steps, logging_steps=10_000,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
        use_cpu=device == "cpu",
    )
    checkpointing = overrides.pop("checkpointing", False)
    fields = TrainingArguments.__dataclass_fields__
    values["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = checkpointing
    values.update(overrides)
    return TrainingArguments(**values)


class StepClock(TrainerCallback):
    """Steady-state seconds per step: the time from step ``warmup``'s end to the last step's end.

    Synchronizes the device only at those two instants, so the steps in between run as in
    production (asynchronously) and per-step host costs show only where they cost time.
    """

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.end: float | None = None
        self.steps = 0

    @staticmethod
    def _now() -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.warmup:
            self.start = self._now()
        elif state.global_step > self.warmup:
            self.end = self._now()
            self.steps = state.global_step - self.warmup

    def seconds_per_step(self) -> float:
        if self.start is None or self.end is None or self.steps < 1:
            raise RuntimeError("the run was shorter than the warm-up")
        return (self.end - self.start) / self.steps


def timed_run(arch: str, *, batch: int, seq_len: int, steps: int, warmup: int, device: str,
              memwatch: bool, tiny: bool = False, workdir: str | None = None) -> float:
    """Seconds per steady-state step of one Trainer run, with or without ``MemWatch(report=False)``.

    ``report=False``: the picture is drawn by a background process at train end, which would run
    during the next timed run.
    """
    model = build_model(arch, tiny=tiny)
    clock = StepClock(warmup)
    callbacks = [clock] + ([MemWatch(report=False)] if memwatch else [])
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        args = training_args(tmp, batch=batch, steps=steps, device=device, bf16=device == "cuda")
        trainer = Trainer(model=model, args=args, train_dataset=dataset_for(model, batch, seq_len, steps),
                          callbacks=callbacks)
        trainer.train()
        seconds = clock.seconds_per_step()
    del trainer, model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds


# -- callbacks reading the device -----------------------------------------------------------------
class PeakWindow(TrainerCallback):
    """Resets the device's peak at every step begin and reads it at step end: placed first in both the
    MemWatch run and its twin, so both measure the same windows."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.peaks: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.probe.reset_peak()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.peaks.append(self.probe.peak())


class AllocatorReader(TrainerCallback):
    """Reads the device's allocated bytes and peak at MemWatch's instants, just before it.

    Placed before ``MemWatch`` in the callback list, it hooks the module MemWatch hooks
    (:func:`~hf_memwatch.integration.compiled.hook_target`), registered first, so its reading comes
    first and its peak covers the same window MemWatch's snapshot does. Where MemWatch does not reset
    this peak counter itself (the CPU probe), the reader resets it after each reading.
    """

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.trainer: Any = None
        self.reads: list[dict[str, Any]] = []
        self.step = 0
        self.in_step = False
        self.hooked: str | None = None

    def _read(self, phase: str) -> None:
        self.probe.synchronize()
        self.reads.append({"step": self.step, "phase": phase, "allocated": self.probe.allocated(),
                           "peak": self.probe.peak()})
        if not self.probe.shares_memwatch_peak:
            self.probe.reset_peak()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        target = hook_target(model, getattr(self.trainer, "model_wrapped", None))
        self.hooked = type(target).__name__
        target.register_forward_hook(self._after_forward)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self.in_step and torch.is_grad_enabled():
            self._read("after_forward")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step, self.in_step = state.global_step + 1, True
        self._read("step_begin")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_backward")

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("after_optimizer")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read("step_end")
        self.in_step = False


class PeakFromTrainBegin(TrainerCallback):
    """Resets the device's peaks once the model is placed and the optimizer built."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.probe.synchronize()
        self.probe.reset_peak()


def train(probe: Probe, model: Any, args: Any, dataset: Any, callbacks: list[Any]) -> Any:
    """One ``Trainer`` run inside the probe's session; the trainer."""
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
    for callback in callbacks:
        if isinstance(callback, AllocatorReader):
            callback.trainer = trainer
    with probe.session(model):
        trainer.train()
    probe.synchronize()
    return trainer


# -- the checks -----------------------------------------------------------------------------------
def check_attribution(ctx: Context) -> CheckResult:
    """Classes sum to the device's allocated bytes at every snapshot; step peaks equal the device's."""
    probe = ctx.probe
    arch, batch, seq_len, steps = ("gpt2", 2, 32, 2) if ctx.quick else ("gpt2", 8, 512, 4)
    accum = 2
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "steps": steps,
                               "gradient_accumulation_steps": accum, "truth": probe.kind}

    def run(tmp: str, callbacks: list[Any]) -> None:
        model = build_model(arch, ctx.quick, probe.device)
        args = training_args(tmp, batch=batch, steps=steps, device=probe.kind, bf16=ctx.cuda,
                             gradient_accumulation_steps=accum)
        train(probe, model, args, dataset_for(model, batch, seq_len, accum * steps), callbacks)
        del model
        probe.free()

    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        started = time.perf_counter()
        window, reader = PeakWindow(probe), AllocatorReader(probe)
        run(tmp, [window, reader, MemWatch(detail="full", report=False, summary=False)])
        records = list(read_timeline(Path(tmp) / "memwatch" / "timeline.jsonl"))
        first_run_s = time.perf_counter() - started
        twin: PeakWindow | None = None
        if ctx.fits(first_run_s):
            twin = PeakWindow(probe)  # unmonitored, peaks reset the same way
            run(tmp + "/twin", [twin])
        else:
            ctx.skip("attribution", "the unmonitored twin run",
                     f"out of time: {ctx.left():.0f} s left, the monitored run took {first_run_s:.0f} s")
    snapshots = [r for r in records if r["event"] == "snapshot"]
    verdict = attribution_verdict(snapshots, reader.reads)
    ours = [r["peak"] for r in records if r["event"] == "step"]
    details.update(verdict, hooked_module=reader.hooked, memwatch_step_peaks=ours)
    problems = list(verdict["mismatches"])
    twin_text = "twin run dropped (time)"
    if twin is not None:
        twin_errors = [relative_error(a, b) for a, b in zip(ours, twin.peaks)]
        details.update(unmonitored_step_peaks=twin.peaks, unmonitored_errors=twin_errors)
        if len(ours) != len(twin.peaks) or any(abs(e) > GOALS["step_peak_rel"] for e in twin_errors):
            problems.append(f"step peaks {ours} vs unmonitored twin {twin.peaks}")
        twin_text = f"unmonitored twin within {max(map(abs, twin_errors), default=0):.2%}"
    summary = (f"{verdict['snapshots']} snapshots: classes sum to the {probe.kind} allocated bytes and step peaks "
               f"equal the {probe.kind} peak; {twin_text}")
    if problems:
        summary = f"{len(problems)} mismatch(es): " + "; ".join(problems[:3])
    return CheckResult("attribution", not problems, summary, details)


def measure_peak(config: Config, ctx: Context) -> dict[str, Any]:
    """Estimate, then train 3 steps (2 quick: the second has the optimizer's states) and read the
    device's peaks, reset once the model is placed."""
    probe, steps = ctx.probe, 2 if ctx.quick else 3
    row: dict[str, Any] = asdict(config)
    if config.qlora:
        model, _, _ = build_qlora_model(config.arch, ctx.quick, probe.device, ctx.workdir)
    else:
        model = build_model(config.arch, ctx.quick, probe.device)
    est = estimate(model, batch_size=config.batch, seq_len=config.seq_len, precision=config.precision,
                   optim=config.optim, checkpointing=config.checkpointing, device=probe.kind)
    row.update(params=est.params, trainable_params=est.trainable_params, predicted=est.peak_bytes,
               predicted_reserved=getattr(est, "reserved_bytes", None),
               predicted_device=getattr(est, "device_bytes", None))
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        args = training_args(tmp, batch=config.batch, steps=steps, device=probe.kind, bf16=config.precision == "bf16",
                             fp16=config.precision == "fp16", optim=config.optim, checkpointing=config.checkpointing)
        trainer = train(probe, model, args, dataset_for(model, config.batch, config.seq_len, steps),
                        [PeakFromTrainBegin(probe)])
        row.update(max_allocated=probe.peak(), max_reserved=probe.peak_reserved(), device_used=probe.device_used(),
                   num_alloc_retries=probe.num_alloc_retries(), num_ooms=probe.num_ooms())
        del trainer
    del model
    probe.free()
    row["error_allocated"] = relative_error(row["predicted"], row["max_allocated"])
    if not ctx.cuda and "bnb" in config.optim:
        row["excluded"] = CPU_BLIND["bnb"]
    for key, predicted, measured in (("error_reserved", "predicted_reserved", "max_reserved"),
                                     ("error_device", "predicted_device", "device_used")):
        if row[predicted] is not None and row[measured]:
            row[key] = relative_error(row[predicted], row[measured])
    return row


def prediction_result(rows: list[dict[str, Any]], planned: int, dropped: list[Config], running: bool) -> CheckResult:
    """The prediction check's verdict over the rows measured so far (``running``: partial, no verdict)."""
    measured = [r for r in rows if "error_allocated" in r and "excluded" not in r]
    failed = [r for r in rows if "error" in r]
    details: dict[str, Any] = {"configurations": rows, "planned": planned,
                               "dropped": [asdict(c) for c in dropped]}
    if not measured:
        return CheckResult("prediction", None if running else False,
                           "running: no configuration measured yet" if running else "no configuration could be measured",
                           details)
    allocated = error_stats([r["error_allocated"] for r in measured])
    reserved_errors = [r["error_reserved"] for r in measured if "error_reserved" in r]
    device_errors = [r["error_device"] for r in measured if "error_device" in r]
    reserved = error_stats(reserved_errors) if reserved_errors else None
    device = error_stats(device_errors) if device_errors else None
    details.update(allocated=allocated, reserved=reserved, device=device)
    text = (f"{len(measured)} of {planned} configurations; vs allocated: median {allocated['median']:.2%}, worst "
            f"{allocated['worst_signed']:+.2%}")
    if reserved:
        text += f"; vs reserved: median {reserved['median']:.2%}, worst {reserved['worst_signed']:+.2%}"
    if device:
        text += f"; vs mem_get_info: median {device['median']:.2%}, worst {device['worst_signed']:+.2%}"
    if failed:
        text += f"; {len(failed)} failed to run"
    if dropped:
        text += f"; {len(dropped)} dropped (time)"
    if running:
        return CheckResult("prediction", None, "running: " + text, details)
    passed = (not failed and allocated["median"] <= GOALS["prediction_median"]
              and allocated["worst"] <= GOALS["prediction_worst"]
              and (reserved is None or reserved["worst"] <= GOALS["reserved_worst"]))
    return CheckResult("prediction", passed, text, details)


def check_prediction(ctx: Context) -> CheckResult:
    """The estimator against the sweep, most informative first; what would not fit the budget is dropped."""
    configs = configurations(ctx.quick)
    rows: list[dict[str, Any]] = []
    longest = 0.0
    started = time.perf_counter()
    dropped: list[Config] = []
    for index, config in enumerate(configs):
        if rows and not ctx.fits(longest):
            dropped = configs[index:]
            ctx.skip("prediction", f"{len(dropped)} configuration(s): " + ", ".join(
                f"{c.arch} {c.batch}x{c.seq_len}" for c in dropped),
                f"out of time: {ctx.left():.0f} s left, the longest configuration took {longest:.0f} s")
            break
        begun = time.perf_counter()
        try:
            rows.append(measure_peak(config, ctx))
        except Exception as exc:  # noqa: BLE001 - one configuration failing is reported, the rest still run
            rows.append({**asdict(config), "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            ctx.probe.free()
        rows[-1]["seconds"] = time.perf_counter() - begun
        longest = max(longest, rows[-1]["seconds"])
        partial = prediction_result(rows, len(configs), [], running=True)
        partial.seconds = time.perf_counter() - started
        ctx.results.publish(partial)
    if not ctx.cuda:
        for what in ("reserved", "mem_get_info"):
            ctx.skip("prediction", f"predicted vs measured {what}", CUDA_ONLY[what])
        excluded = [r for r in rows if "excluded" in r]
        if excluded:
            ctx.skip("prediction", f"{len(excluded)} 8-bit AdamW configuration(s) in the statistics", CPU_BLIND["bnb"])
    return prediction_result(rows, len(configs), dropped, running=False)


def _auto_run(ctx: Context, arch: str, batch: int, seq_len: int, steps: int, memwatch: Any,
              **overrides: Any) -> dict[str, Any]:
    """One Trainer run of the prevention check, never raising: completion, OOMs, peaks, the plan."""
    probe = ctx.probe
    probe.free()
    ooms_before = probe.num_ooms()
    started = time.perf_counter()
    outcome: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=ctx.workdir) as tmp:
        try:
            model = build_model(arch, ctx.quick, probe.device)
            args = training_args(tmp, batch=batch, steps=steps, device=probe.kind, bf16=ctx.cuda, **overrides)
            callbacks = [PeakFromTrainBegin(probe)] + ([memwatch] if memwatch is not None else [])
            trainer = train(probe, model, args, dataset_for(model, batch, seq_len, 4 * steps), callbacks)
            outcome.update(completed=True, final_micro_batch=trainer._train_batch_size,
                           gradient_accumulation_steps=trainer.args.gradient_accumulation_steps,
                           global_steps=trainer.state.global_step)
            if memwatch is not None and memwatch.auto_plan:
                outcome["plan"] = dict(memwatch.auto_plan)
            del trainer, model
        except Exception as exc:  # noqa: BLE001 - the verdict records it
            outcome.update(completed=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        timeline = Path(tmp) / "memwatch" / "timeline.jsonl"
        snaps = [r for r in read_timeline(timeline) if r["event"] == "snapshot"] if timeline.exists() else []
    outcome["seconds"] = time.perf_counter() - started
    if ooms_before is not None:
        outcome["num_ooms"] = (probe.num_ooms() or 0) - ooms_before
        outcome["num_alloc_retries"] = probe.num_alloc_retries()
    if ctx.cuda:
        # MemWatch resets the allocator's peaks at every snapshot; without empty_cache (and without a
        # retry, which frees cached blocks: num_alloc_retries) reserved only grows, so its value at
        # the end and at every snapshot bound the run's peak from below.
        outcome["measured"] = max(probe.peak_reserved() or 0, probe.reserved() or 0,
                                  max((r.get("reserved") or 0 for r in snaps), default=0))
    else:
        outcome["measured"] = probe.peak()  # the CPU tracker: MemWatch does not reset it
    probe.free()
    return outcome


def _plan_prediction(ctx: Context, arch: str, seq_len: int, plan: dict[str, Any] | None) -> int | None:
    """The auto plan's predicted bytes (reserved on CUDA, allocated on the CPU), by the estimator."""
    if not plan or plan.get("micro_batch_size") is None:
        return None
    est = estimate(build_model(arch, ctx.quick, "cpu"), batch_size=plan["micro_batch_size"],
                   seq_len=seq_len, accum=plan["gradient_accumulation_steps"],
                   checkpointing=bool(plan["activation_checkpointing"]), optim=plan["optim"],
                   precision="bf16" if ctx.cuda else "fp32", device=ctx.probe.kind)
    reserved = getattr(est, "reserved_bytes", None)
    return reserved if ctx.cuda and reserved is not None else est.peak_bytes


def check_prevention(ctx: Context) -> CheckResult:
    """A limit at half the configured batch's need: the auto mode must fit it, as its plan predicted."""
    probe = ctx.probe
    arch, batch, seq_len, steps = ("gpt2", 8, 64, 2) if ctx.quick else ("gpt2", 32, 1024, 4)
    configured = estimate(build_model(arch, ctx.quick, "cpu"), batch_size=batch,
                          seq_len=seq_len, precision="bf16" if ctx.cuda else "fp32", device=probe.kind)
    need = getattr(configured, "reserved_bytes", None) or configured.peak_bytes
    allowed = int(0.5 * need)  # half of what the configured batch needs
    details: dict[str, Any] = {"arch": arch, "batch": batch, "seq_len": seq_len, "predicted_configured": need,
                               "allowed": allowed}
    if ctx.cuda:
        total = probe.total_memory() or 1
        fraction = min(1.0, allowed / total)
        details["fraction"] = fraction
        torch.cuda.set_per_process_memory_fraction(fraction, probe.device)
        memwatch = MemWatch(auto=True, report=False, summary=False)  # the default budget reads the fraction
    else:
        ctx.skip("prevention", "set_per_process_memory_fraction and num_ooms", CUDA_ONLY["fraction"])
        memwatch = MemWatch(auto=True, budget=allowed, report=False, summary=False)
    try:
        auto = _auto_run(ctx, arch, batch, seq_len, steps, memwatch)
        details["memwatch_auto"] = auto
        if ctx.cuda and not auto.get("completed") and ctx.fits(auto["seconds"]):
            # Tell a planning failure from a limit the auto mode could not see.
            details["memwatch_auto_explicit_budget"] = _auto_run(
                ctx, arch, batch, seq_len, steps, MemWatch(auto=True, budget=allowed, report=False, summary=False))
        if not ctx.cuda:
            ctx.skip("prevention", "auto_find_batch_size", CUDA_ONLY["auto_find_batch_size"])
        elif ctx.fits(auto["seconds"]):
            details["auto_find_batch_size"] = _auto_run(ctx, arch, batch, seq_len, steps, None,
                                                        auto_find_batch_size=True)
        else:
            ctx.skip("prevention", "auto_find_batch_size", f"out of time: {ctx.left():.0f} s left")
    finally:
        if ctx.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, probe.device)
    predicted = _plan_prediction(ctx, arch, seq_len, auto.get("plan"))
    details["plan_predicted"] = predicted
    passed, why = prevention_verdict(auto, allowed, predicted)
    summary = f"MemWatch(auto=True) within {allowed / 2**20:,.1f} MiB: {why}"
    hf = details.get("auto_find_batch_size")
    if hf:
        summary += (f". auto_find_batch_size: completed at micro-batch {hf.get('final_micro_batch')} after "
                    f"{hf.get('num_ooms')} OOM(s)" if hf.get("completed") else f". auto_find_batch_size: failed "
                    f"({hf.get('error')})")
    return CheckResult("prevention", passed, summary, details)


def check_overhead(ctx: Context) -> CheckResult:
    """MemWatch(report=False) vs none: interleaved runs, ratio of median seconds per step."""
    rounds = 3
    shape = ({"arch": "gpt2", "batch": 2, "seq_len": 32, "steps": 6, "warmup": 2} if ctx.quick
             else {"arch": "gpt2", "batch": 8, "seq_len": 512, "steps": 40, "warmup": 10})
    durations: list[float] = []

    def measure(memwatch: bool) -> Callable[[], float]:
        def run() -> float:
            begun = time.perf_counter()
            seconds = timed_run(shape["arch"], batch=shape["batch"], seq_len=shape["seq_len"], steps=shape["steps"],
                                warmup=shape["warmup"], device=ctx.probe.kind, memwatch=memwatch, tiny=ctx.quick,
                                workdir=ctx.workdir)
            durations.append(time.perf_counter() - begun)
            return seconds
        return run

    without, with_memwatch = interleaved(measure(False), measure(True), rounds,
                                         keep_going=lambda: ctx.fits(2 * max(durations)))
    if len(without) < rounds:
        ctx.skip("overhead", f"{rounds - len(without)} of {rounds} rounds", f"out of time: {ctx.left():.0f} s left")
    ratio = overhead_ratio(without, with_memwatch)
    details = {**shape, "rounds": len(without), "seconds_without": without, "seconds_with": with_memwatch,
               "ratio": ratio, "memwatch": "MemWatch(report=False): no background picture process while timing"}
    summary = (f"{ratio:.4f}x step time with MemWatch() (median of {len(without)} interleaved runs of "
               f"{shape['steps'] - shape['warmup']} steady steps; goal <= {GOALS['overhead_ratio']})")
    passed = ratio <= GOALS["overhead_ratio"] if ctx.cuda else True  # CPU timing: reported, no goal
    if not ctx.cuda:
        ctx.skip("overhead", "the 1.01 goal", CUDA_ONLY["overhead_goal"])
    return CheckResult("overhead", passed, summary, details)


CHECKS: dict[str, Callable[[Context], CheckResult]] = {
    "attribution": check_attribution,
    "prediction": check_prediction,
    "prevention": check_prevention,
    "overhead": check_overhead,
}


def environment(probe: Probe, quick: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"device": probe.kind, "quick": quick, "torch": torch.__version__,
                            "transformers": transformers.__version__, "python": platform.python_version()}
    if probe.kind == "cuda":
        props = torch.cuda.get_device_properties(probe.device)
        info.update(gpu=props.name, gpu_memory=f"{props.total_memory / 2**30:.0f} GiB", cuda=torch.version.cuda)
    return info


def make_probe(device: str) -> Probe:
    if device == "cuda":
        return CudaProbe(torch.device("cuda", torch.cuda.current_device()))
    return CpuProbe(torch.device("cpu"))


def run_checks(names: Sequence[str], time_budget_s: float, workdir: str, results: ResultsFile, probe: Probe,
               quick: bool) -> list[CheckResult]:
    """Run the named checks in order, each within its share of the budget; results published as they come."""
    started = time.perf_counter()
    for name in names:
        results.publish(CheckResult(name, None, "not run yet"))
    for index, name in enumerate(names):
        deadline = check_deadline(started, time_budget_s, name, names[index:])
        ctx = Context(probe, workdir, quick, deadline, results)
        if ctx.left() <= 0:
            results.publish(CheckResult(name, None, f"not run: the {time_budget_s:.0f} s budget was spent"))
            continue
        results.publish(CheckResult(name, None, "running"))
        check_started = time.perf_counter()
        try:
            result = CHECKS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - a crashed check is a failed check, the others still run
            result = CheckResult(name, False, f"crashed: {type(exc).__name__}: {exc}",
                                 {"traceback": traceback.format_exc()})
            probe.free()
        result.seconds = time.perf_counter() - check_started
        print(f"gpu-check: {name}: {verdict_word(result)} - {result.summary}", flush=True)
        results.publish(result)
    return list(results.results.values())


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    probe = make_probe(args.device)
    results = ResultsFile(args.out, environment(probe, args.quick))
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        checks = run_checks(args.checks, args.time_budget_s, workdir, results, probe, args.quick)
    results.status = "finished"
    results.publish()
    json_path, md_path = results.paths
    print(f"gpu-check: wrote {json_path} and {md_path}")
    return 0 if all(r.passed for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
