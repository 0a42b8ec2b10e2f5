"""The CUDA estimate against published GPU measurements nobody here tuned on (issue #32, point 5).

Each :class:`Case` is one configuration someone measured on a real card and published with its
settings: the source, the model (built here from its architecture's hyper-parameters with
Transformers' config classes: no hub access), batch, sequence length, precision, optimizer,
checkpointing, accumulation, the card (a name of :mod:`hf_memwatch.core.gpus`; a stand-in of
the same compute capability where the card is not in that table, said in ``gpu_note``), the measured
figure and what it is:

* ``allocated`` — ``torch.cuda.max_memory_allocated``: compared with ``peak_bytes``;
* ``reserved`` — ``torch.cuda.max_memory_reserved``: compared with ``reserved_bytes``;
* ``nvidia-smi`` — the device's used memory (NVML): compared with the predicted reserve plus the CUDA
  context *the source measured on the same machine* (``context``), else with ``device_bytes``
  (None where no CUDA device is at hand: then the reserve alone, marked "context unknown").
  ``device_bytes`` is shown beside whenever the estimate gives it.

Two measuring protocols occur. ``trainer``: ``Trainer.train()``, replayed by ``estimate(config, ...)``, or, where
the run loaded its model in half precision without autocast (``weights_dtype``: [F]'s bf16 runs), by
``estimate(model, ...)`` on a meta-device model of that dtype (:func:`half_model`), a LoRA adapter where the
run had one (``lora``).
``logits_sum``: the SDPA benchmark script of the Transformers model docs (fxmarty's
``benchmark_sdpa_training`` gist and its copies): the model loaded in float16 (no autocast), per step
``model.zero_grad(); outputs = model(**inputs); outputs.logits.sum().backward()``, no optimizer,
``max_memory_allocated`` over the timed steps. It is replayed by ``estimate(LogitsSum(model), ...,
optimizer_step=False)`` on a meta-device float16 model: :class:`LogitsSum` is that script's loss.
The script's ``outputs`` variable keeps each step's outputs alive through its backward and until the
next forward returns (a Python variable rebound after the call): :class:`LogitsSum` holds them the same
way, the previous step's through this step's forward included, so the replay counts them (the logits'
size is named in the case's explanation). Where the measured transformers' modelling code keeps other
tensors than the installed one's, the case names it (``modelling``) and :mod:`cuda_published_models`
replays that code's data flow (GPT-NeoX as 4.42 ran it).

The settings each case is estimated with are the ones its Transformers/torch version used (eager
attention before SDPA existed, the optimizer of that time), written per case in ``settings``; the
explanation column names the CUDA behaviour (or the protocol term) each known gap comes from. Nothing
here is fitted to these figures.

    python benchmarks/cuda_published.py --out benchmarks/results/cuda_published.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, DistilBertConfig, GPTNeoXConfig, MistralConfig  # noqa: E402

from hf_memwatch import estimate  # noqa: E402
from hf_memwatch.estimation.fake_model import auto_class  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when imported by path
from cuda_published_models import (  # noqa: E402
    LOSS_4_48,
    NEOX_4_42,
    TRAINER_4_16,
    TRAINER_4_30,
    causal_lm_loss_4_48,
    gpt_neox_4_42,
    per_parameter_adamw,
    torch_1_10,
)

MiB = 1 << 20
MB = 10**6
KINDS = ("allocated", "reserved", "nvidia-smi")
LOOPS = ("trainer", "logits_sum")
RESULTS = Path(__file__).parent / "results" / "cuda_published.md"


# -- the models, from their published hyper-parameters ---------------------------------------------
def bert_large() -> BertConfig:
    """bert-large-uncased: 24 layers, hidden 1024, 16 heads, FFN 4096, vocab 30522 (BertConfig's other defaults)."""
    return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                      vocab_size=30522, max_position_embeddings=512)


def bert_base() -> BertConfig:
    """bert-base-uncased: BertConfig()'s defaults (12 layers, hidden 768, 12 heads, FFN 3072, vocab 30522)."""
    return BertConfig()


def distilbert_base() -> DistilBertConfig:
    """distilbert-base-uncased: DistilBertConfig()'s defaults (6 layers, dim 768, 12 heads, FFN 3072, vocab 30522)."""
    return DistilBertConfig()


def pythia_410m() -> GPTNeoXConfig:
    """EleutherAI/pythia-410m-deduped's config.json: 24 layers, hidden 1024, 16 heads, FFN 4096, vocab 50304,
    rotary_pct 0.25, parallel residual, untied embeddings (dropouts: GPTNeoXConfig's 0.0)."""
    return GPTNeoXConfig(vocab_size=50304, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096, rotary_pct=0.25, rotary_emb_base=10000, max_position_embeddings=2048,
                         use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def mistral_7b() -> MistralConfig:
    """mistralai/Mistral-7B-v0.1's config.json: 32 layers, hidden 4096, 32 heads, 8 key/value heads, FFN 14336,
    vocab 32000, rope_theta 10000, sliding window 4096, untied embeddings."""
    return MistralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                         rope_theta=10000.0, sliding_window=4096, rms_norm_eps=1e-5, tie_word_embeddings=False)


class LogitsSum(torch.nn.Module):
    """The SDPA benchmark script's step: ``outputs = model(input_ids=...)``, ``outputs.logits.sum()`` (no labels,
    no loss head), with the model's outputs held as the script's ``outputs`` variable holds them: a step's
    through its backward and until the next step's forward returns (the name is rebound after the call).

    So the previous step's outputs are alive during this step's forward: replayed by a no-grad forward of
    the same inputs just before it (the same output tensors, with no saved activations, as the previous
    step leaves them once its backward freed its graph), released when this forward returns; this step's
    are kept in ``held``. The outputs are the logits and, where the run's modelling code returns them
    (``presents``: the holder :func:`cuda_published_models.gpt_neox_4_42` fills), the per-layer cache.
    """

    def __init__(self, inner: torch.nn.Module, presents: list | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.presents = presents

    def outputs(self, input_ids: torch.Tensor) -> tuple:
        """One call's outputs: the logits, then the cache the run's code returned (if any)."""
        if self.presents is not None:
            self.presents[0] = []
        logits = self.inner(input_ids=input_ids).logits
        return (logits, *(self.presents[0] if self.presents is not None else ()))

    def forward(self, input_ids: torch.Tensor, **_: Any) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            previous = self.outputs(input_ids)  # the step before's outputs, still bound to ``outputs``
        outputs = self.outputs(input_ids)
        del previous  # ``outputs = model(...)`` rebinds once the call returns
        self.held = outputs
        return {"loss": outputs[0].sum()}


# -- the cases ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One published measurement and the configuration it was made with."""

    key: str
    source: str
    model: str
    config: Callable[[], Any]
    task: str
    batch: int
    seq: int
    precision: str          # the estimate's: fp32 (no autocast), fp16/bf16 (autocast)
    optim: str | None       # None: forward and backward only (no optimizer)
    checkpointing: bool
    accum: int
    gpu: str                # a name of hf_memwatch.core.gpus.GPUS
    attn: str               # the attention implementation the run used: eager | sdpa
    measured: int           # bytes
    kind: str               # allocated | reserved | nvidia-smi
    versions: str
    settings: str           # how that run's versions are passed on here
    explanation: str        # the known gaps and the CUDA behaviour (or protocol term) behind each
    loop: str = "trainer"   # trainer | logits_sum
    weights_dtype: str | None = None  # "fp16"/"bf16": the model loaded in half precision, no autocast
    lora: tuple | None = None         # (r, alpha, target modules, dropout): peft.LoraConfig's
    context: int | None = None        # the CUDA context the source measured on that machine (bytes)
    gpu_note: str = ""
    modelling: str = ""  # the run's modelling code where it keeps other tensors than the installed one's


PERF_GUIDE = ("transformers docs/source/en/perf_train_gpu_one.mdx (v4.16-v4.21, Jan 2022), "
              "https://huggingface.co/docs/transformers/v4.21.0/perf_train_gpu_one")
PERF_VERSIONS = "Tesla V100-SXM2 16160 MiB, driver 460.91.03, CUDA 11.2; transformers ~4.16, torch ~1.10"
PERF_CONTEXT = 1343 * MiB  # the page's "torch.ones((1, 1)).to('cuda')": GPU memory occupied 1343 MB (MiB)
PERF_SETTINGS = ("eager attention (BERT had no SDPA then); default_data_collator: input_ids + labels, "
                 "no attention_mask; seq-cls, 2 labels; AdamW: transformers.AdamW (adamw_hf, a per-parameter "
                 "loop) passed as adamw_torch, stepped per parameter; torch 1.10 as 4.16's Trainer drove it, replayed "
                 "(cuda_published_models.torch_1_10): model.zero_grad() with set_to_none=False (gradients kept "
                 "allocated), softmax saving its input; checkpointing replayed as 5.23's non-reentrant kind (2022's "
                 "was reentrant)")
CONTEXT_NOTE = ("nvidia-smi after train(): the peak segments stay cached (train() calls no empty_cache), so the "
                "figure is peak reserved + the 1343 MiB context the page measured (CUDA 11.2 loads every kernel at "
                "init; a lazily loading CUDA >= 11.7 context is smaller: device_bytes, where given, is not this run's)")
ZERO_GRAD_NOTE = ("4.16's Trainer zeroed the gradients in place (model.zero_grad(), torch 1.10's set_to_none=False: "
                  "cuda_published_models.gradients_kept), so they stay allocated through the next forward")
BNB_STEP = ("bitsandbytes' CUDA optimizer kernels update the weight and states in place, no temporaries "
            "(estimation/cuda_libs.py); replayed with its CPU kernel's fp32 temporaries (5 x 4 B a element of "
            "each parameter at the step), as before 2026-12-05, the reserve read {before}")
FOREACH = ("2022's transformers.AdamW (adamw_hf) stepped one parameter at a time: replayed as torch's "
           "single-tensor AdamW (cuda_published_models.per_parameter_adamw); with the foreach AdamW torch >= 2.0 "
           "picks on CUDA (_foreach_sqrt of the second moments, one parameter-size list, 1.25 GiB here) the peak "
           "moved to the optimizer step: +6.9..+14.6%")
FWD_BWD_FP32 = ("peak in the forward/backward, fp32, eager; torch 1.10's softmax node saved its input beside its "
                "output (pytorch#64000, fixed in 1.11 by #66018): the fp32 scores, 4x16x512x512 x 4 B = 64 MiB a "
                "layer, 1.5 GiB over 24 layers, replayed (cuda_published_models.softmax_keeps_input); without it "
                "-17.5..-20.8%")
AMP_NOTE = ("torch.cuda.amp: CUDA's autocast lists (ATen/autocast_mode.h: softmax in AT_FORALL_FP32_SET_OPT_DTYPE, "
            "layer_norm in AT_FORALL_FP32) give fp32 outputs: per layer the attention probabilities are saved in "
            "fp32 (4x16x512x512 x 4 B = 64 MiB) beside the fp16 copy the next matmul saves, and both LayerNorm "
            "outputs are fp32 beside their fp16 copies, which a replay under CPU autocast's lists misses; torch "
            "1.10's softmax also saved its input, here the fp32 copy autocast made (64 MiB a layer, replayed: "
            "cuda_published_models.softmax_keeps_input); -22.5% before both 2022 behaviours were replayed")
AMP_GC_NOTE = ("torch.cuda.amp with checkpointing: the fp32 softmax of CUDA's autocast lists is recomputed inside "
               "one layer at a time, so it weighs one layer, not 24")
BERT_SDPA = ("transformers docs/source/en/model_doc/bert.md (v4.39-v4.47; ko/ar translations keep it), "
             "PR #28802, gist hackyon/2bfcfb59666fab23655f6e62bc0752ba")
BERT_SDPA_VERSIONS = "A100-80GB, PyTorch 2.2.0, transformers 4.39 dev (PR #28802)"
NEOX_SDPA = ("transformers docs/source/en/model_doc/gpt_neox.md (SDPA section, training table), PR #31031 "
             "(vasqu)")
NEOX_VERSIONS = ("RTX 3080 Ti 16 GB (sm_86), PyTorch 2.2.1, transformers 4.42 dev (PR #31031); the script is "
                 "\"based on fxmarty's\": its AutoModelForCausalLM form with input_ids only is assumed")
NEOX_COMMON = ("the run's modelling code replayed: transformers 4.42's GPT-NeoX (cuda_published_models.py): a "
               "2048x2048 bool causal-mask buffer per layer (100.7 MB), fp32 rotary buffers that make query and key "
               "fp32, and per layer the outputs' present (the fp32 key, and the whole fp16 qkv its value view "
               "keeps); the peak is at the forward's end, the previous step's outputs (its logits and presents) "
               "still bound to the script's variable (LogitsSum); with 5.23's code and this step's logits only: "
               "-7.5..-18.2%, no CUDA behaviour involved")
DISTIL_SDPA = "transformers docs/source/en/model_doc/distilbert.md (SDPA section, training table)"
DISTIL_VERSIONS = "GeForce RTX 2060 8 GB (sm_75), PyTorch 2.3.1, transformers ~4.42"
SCRIPT_SETTINGS = ("fxmarty's benchmark_sdpa_training script: from_pretrained(torch_dtype=float16, "
                   "attn_implementation=...), inputs: input_ids only; per step zero_grad (set_to_none), "
                   "forward, logits.sum().backward(); no optimizer; max_memory_allocated * 1e-6 (MB)")
HELD_LOGITS = ("the script's outputs (fp16 logits, {held} MB) held through the backward and the next forward "
               "(script protocol, replayed by LogitsSum)")


def _perf(key: str, batch: int, accum: int, precision: str, optim: str, checkpointing: bool, used_mib: int,
          extra: str) -> Case:
    return Case(key=key, source=PERF_GUIDE, model="bert-large-uncased (BertForSequenceClassification)",
                config=bert_large, task="seq-cls", batch=batch, seq=512, precision=precision, optim=optim,
                checkpointing=checkpointing, accum=accum, gpu="V100-16GB", attn="eager",
                measured=used_mib * MiB, kind="nvidia-smi", versions=PERF_VERSIONS, settings=PERF_SETTINGS,
                explanation=f"{extra}; {ZERO_GRAD_NOTE}; {CONTEXT_NOTE}", context=PERF_CONTEXT, modelling=TRAINER_4_16)


def _script(key: str, source: str, model: str, config: Callable[[], Any], task: str, batch: int, seq: int,
            attn: str, mb: float, gpu: str, versions: str, explanation: str, gpu_note: str = "",
            modelling: str = "") -> Case:
    return Case(key=key, source=source, model=model, config=config, task=task, batch=batch, seq=seq,
                precision="fp32", optim=None, checkpointing=False, accum=1, gpu=gpu, attn=attn,
                measured=round(mb * MB), kind="allocated", versions=versions, settings=SCRIPT_SETTINGS,
                explanation=explanation, loop="logits_sum", weights_dtype="fp16", gpu_note=gpu_note,
                modelling=modelling)


REPLAY_2023 = ("anmechkoe/GPTlearning, GPT学习代码/exp13-accelerate/{1..5}*.ipynb at commit 3766829 (2023-07-27; "
               "the perf guide's notebook rerun on other hardware and versions), "
               "https://github.com/anmechkoe/GPTlearning")
REPLAY_2023_VERSIONS = ("2 x GeForce RTX 3090 24 GB (sm_86), torch 2.0.1+cu117 (install.ipynb), transformers ~4.30 "
                        "(its AdamW's deprecation warning, optimization.py:411), python 3.8; NVML used memory of "
                        "both cards summed: 620 MiB before torch, 1276 MiB after torch.ones((1, 1)).to('cuda:0')")
REPLAY_2023_CONTEXT = 1276 * MiB  # the notebook's figure after the first tensor: the context plus the 620 MiB held before
REPLAY_2023_SETTINGS = ("the perf guide's protocol (bert-large-uncased seq-cls, 512 x 512 random ids, input_ids + labels, "
                        "eager attention); optim adamw_hf (transformers.AdamW, 4.30's default: per parameter, "
                        "cuda_published_models.per_parameter_adamw); torch 2.0: zero_grad(set_to_none=True) and "
                        "softmax saving its output, as the replay; 4.30's reentrant checkpointing replayed as "
                        "5.23's non-reentrant kind; each figure the first train() of a fresh kernel, or one after "
                        "train() freed the cache (4.30's _inner_training_loop starts with accelerator.free_memory())")
LAZY_NOTE = ("nvidia-smi (NVML) after train(): peak reserved + the 1276 MiB the notebook measured after its first "
             "tensor. CUDA 11.7 loads kernels lazily (torch 2.0 sets CUDA_MODULE_LOADING=LAZY), so the kernel images "
             "the step loads after that tensor (torch's, cuBLAS's) are in the measured figure and in no predicted "
             "one: at most 1,029 MiB, the RTX 3090's eager-loading context (1,685 MiB, "
             "cuda_device.PUBLISHED_CONTEXTS) less the 656 MiB the notebook's first tensor cost; the under-prediction "
             "here is within that. Explained, not modelled: no published measurement gives the size of the images a "
             "step loads lazily (see 'The lazy-loading gap' below), and no constant is fitted to this source")


def _replay_2023(key: str, batch: int, accum: int, precision: str, optim: str, checkpointing: bool, used_mib: int,
                 extra: str) -> Case:
    return Case(key=key, source=REPLAY_2023, model="bert-large-uncased (BertForSequenceClassification)",
                config=bert_large, task="seq-cls", batch=batch, seq=512, precision=precision, optim=optim,
                checkpointing=checkpointing, accum=accum, gpu="RTX-3090", attn="eager",
                measured=used_mib * MiB, kind="nvidia-smi", versions=REPLAY_2023_VERSIONS,
                settings=REPLAY_2023_SETTINGS, explanation=f"{extra}; {LAZY_NOTE}", context=REPLAY_2023_CONTEXT,
                modelling=TRAINER_4_30 if optim == "adamw_torch" else "")


FMS = ("foundation-model-stack/fms-acceleration, scripts/benchmarks/refs/a100_80gb.csv at commit 24bdadb "
       "(2025-02-07), with its scenarios.yaml, defaults.yaml, benchmark.py and refs/requirements.txt, "
       "https://github.com/foundation-model-stack/fms-acceleration")
FMS_VERSIONS = ("A100 80 GB (the reference file's name; the CSV drops the logged device name), one GPU; torch 2.4.1 with "
                "the CUDA 12.1 runtime, transformers 4.48.1, trl 0.13.0, peft 0.13.2, flash-attn 2.7.3, fms-hf-tuning "
                "2.5.0 (refs/requirements.txt)")
FMS_SETTINGS = ("python -m tuning.sft_trainer (one GPU: no accelerate, no FSDP); the model loaded with torch_dtype "
                "bfloat16, no bf16/fp16 flag (no autocast: the weights, gradients and AdamW states are bf16); "
                "yahma/alpaca-cleaned packed to max_seq_len 4096 (fms-hf-tuning 2.5's setup_dataprocessor caps it at "
                "the tokenizer's model_max_length, Mistral's far above), labels = input_ids, no attention mask; "
                "flash_attention_2 replayed as SDPA's flash kernel on sm_80 (bf16, head_dim 128: flash_attn_func "
                "saves q, k, v, out and logsumexp, as SDPA's flash does); gradient checkpointing (4.48's reentrant "
                "kind replayed as 5.23's non-reentrant one); optim adamw_torch (4.48's default: foreach on CUDA); "
                "gradient_accumulation_steps 1, max_grad_norm 1.0; nvidia-smi --query-gpu memory.used every 1 s, "
                "the figure its peak less its first reading (benchmark.py get_peak_mem_usage_by_device_id): the "
                "process's context and reserve")
FMS_CONTEXT = ("nvidia-smi's peak less its first reading: the process's own device memory, compared with "
               "device_bytes = reserved + the published lazy context (253.75 MiB, pytorch#86509: no A100 / CUDA 12 "
               "figure is published); CUDA 12.1 loads kernels lazily, so the kernel images the step loads are in "
               "the measured figure and in no predicted one (see 'The lazy-loading gap')")
FMS_LORA = ("LoRA r 16, alpha 16, dropout 0.1 on q/k/v/o_proj: peft's get_peft_model defaults "
            "(autocast_adapter_dtype=True: fp32 adapters on the bf16 base, as 0.13.2 did); only the adapters "
            "trained, their AdamW states fp32; 4.48's ForCausalLMLoss replayed (cuda_published_models."
            "causal_lm_loss_4_48: a contiguous fp32 copy of the shifted logits, 2.1 GB per 4 x 4096 x 32000; "
            "with 5.23's loss the replay's peak allocated was 4.4-6.1% under); the source's peak allocated, "
            "{alloc} B, is replayed to {alloc_err}. The device figure is {gap} over the prediction: the "
            "context and the kernel images the process loads lazily under CUDA 12.1 (torch's, cuBLAS's, "
            "flash-attn's sm_80 kernels: no published size, see 'The lazy-loading gap'), and any reserve the "
            "replay's allocator does not make; the source gives no context or reserved figure to split it")
FMS_FULL = ("full fine-tuning in bf16: weights, gradients and both AdamW states bf16 (4 x 7.24 G parameters x 2 B), "
            "foreach AdamW's temporaries at the step (the peak); the source's peak allocated, {alloc} B, is "
            "replayed to {alloc_err}. The reserve is at the card's limit: the measured figure falls from bs 4 to "
            "bs 8 (77,256 then 72,988 MiB), torch releasing cached segments inside a failed cudaMalloc and "
            "retrying (num_alloc_retries). The replay takes that path where its reserve meets its limit: the "
            "card's CUDA total (gpus.py: 79.25 GiB, cudaMemGetInfo's, not nvidia-smi's 81,920 MiB, which was the "
            "limit before 2026-12-06) less the context the estimate assumes (the published lazy 253.75 MiB). "
            "Both replays meet it and free their cache once: bs 8's reserve falls by 0.9 GB (+11.3% -> +10.1%), "
            "bs 4's high is the same after the retry. The process held more outside the allocator (the LoRA "
            "rows' gaps: context and lazily loaded kernels, 1.6-1.9 GB), so the real limit was likely lower and "
            "torch freed more than the replay does; the source gives no reserved or context figure to model "
            "that with")


def _fms(key: str, batch: int, lora: bool, used_mib: int, alloc: int, alloc_err: str, gap: str = "") -> Case:
    note = (FMS_LORA if lora else FMS_FULL).format(alloc=f"{alloc:,}", alloc_err=alloc_err, gap=gap)
    return Case(key=key, source=FMS, model="Mistral-7B-v0.1 (MistralForCausalLM)", config=mistral_7b,
                task="causal-lm", batch=batch, seq=4096, precision="fp32", optim="adamw_torch", checkpointing=True,
                accum=1, gpu="A100-80GB", attn="sdpa", measured=used_mib * MiB, kind="nvidia-smi",
                versions=FMS_VERSIONS, settings=FMS_SETTINGS, explanation=f"{note}; {FMS_CONTEXT}",
                weights_dtype="bf16", lora=(16, 16, ("q_proj", "k_proj", "v_proj", "o_proj"), 0.1) if lora else None,
                modelling=LOSS_4_48)


EAGER_NOTE = ("eager attention, fp16: the same kernels on either device; the attention code is transformers "
              "5.23's eager_attention_forward, not the measured version's")
MATH_PATH = ("the replay runs the CUDA kernel sdp_utils picks for the card (estimation/cuda_sdpa.py), attention "
             "dropout 0.1 inside it; a replay that dispatched as on the CPU took the math path (torch's CPU flash "
             "kernel refuses dropout: sdp_utils_cpp.cpp, check_for_dropout), +49..+183% before")
FLASH_NOTE = ("SDPA on sm_80, fp16, no mask (an all-ones mask is dropped before SDPA): the run took the flash "
              f"kernel, which saves its output and logsumexp only; {MATH_PATH}")
CAUSAL_FLASH_NOTE = ("SDPA on sm_86, fp16, causal without a mask (is_causal): the run took the flash kernel, "
                     "which saves its output and logsumexp only; with attention dropout 0 the replay takes torch's "
                     "CPU flash kernel, which saves the same: like for like")
MEMEFF_NOTE = ("SDPA on sm_75 (flash needs sm_80): the run took the memory-efficient kernel, which saves its "
               f"output and logsumexp only; {MATH_PATH}")

CASES: tuple[Case, ...] = (
    _perf("perf-vanilla", 4, 1, "fp32", "adamw_torch", False, 14949, FWD_BWD_FP32),
    _perf("perf-accum", 1, 4, "fp32", "adamw_torch", False, 8681,
          f"peak in the backward with the gradients resident; {FOREACH}"),
    _perf("perf-accum-gc", 1, 4, "fp32", "adamw_torch", True, 6775,
          f"2022's reentrant torch.utils.checkpoint replayed as 5.23's non-reentrant one; {FOREACH}"),
    _perf("perf-fp16", 4, 1, "fp16", "adamw_torch", False, 13939, AMP_NOTE),
    _perf("perf-accum-gc-fp16", 1, 4, "fp16", "adamw_torch", True, 7275, f"{AMP_GC_NOTE}; {FOREACH}"),
    _perf("perf-adafactor", 4, 1, "fp32", "adafactor", False, 12295,
          f"transformers' Adafactor (the same class today); {FWD_BWD_FP32}"),
    _perf("perf-accum-gc-fp16-adafactor", 1, 4, "fp16", "adafactor", True, 4847,
          f"transformers' Adafactor; {AMP_GC_NOTE}"),
    _perf("perf-adam8bit", 4, 1, "fp32", "adamw_bnb_8bit", False, 13085,
          "bnb.optim.Adam8bit (min_8bit_size 4096: small tensors keep fp32 state) estimated as adamw_bnb_8bit "
          f"(bnb AdamW, 8-bit: the same state sizes); {BNB_STEP.format(before='+4.8%')}; {FWD_BWD_FP32}"),
    _perf("perf-accum-gc-fp16-adam8bit", 1, 4, "fp16", "adamw_bnb_8bit", True, 5363,
          f"bnb.optim.Adam8bit as adamw_bnb_8bit; {BNB_STEP.format(before='+5.6%')}; {AMP_GC_NOTE}"),
    *(
        _script(f"bert-sdpa-{attn}-{b}x{s}", BERT_SDPA, "bert-base-uncased (BertLMHeadModel, is_decoder=False)",
                bert_base, "causal-lm", b, s, attn, mb, "A100-80GB", BERT_SDPA_VERSIONS,
                f"{EAGER_NOTE if attn == 'eager' else FLASH_NOTE}; {HELD_LOGITS}")
        for attn, b, s, mb in (("eager", 4, 256, 939.213), ("sdpa", 4, 256, 764.834),
                               ("eager", 8, 512, 3629.401), ("sdpa", 8, 512, 2134.262),
                               ("eager", 16, 512, 6964.659), ("sdpa", 16, 512, 3961.013))
    ),
    *(
        _script(f"neox-sdpa-{attn}-{b}x{s}", NEOX_SDPA, "pythia-410m-deduped (GPTNeoXForCausalLM)", pythia_410m,
                "causal-lm", b, s, attn, mb, "RTX-3090", NEOX_VERSIONS,
                f"{EAGER_NOTE if attn == 'eager' else CAUSAL_FLASH_NOTE}; {NEOX_COMMON}; {HELD_LOGITS}",
                gpu_note="the RTX 3080 Ti is not in gpus.py: RTX-3090 (sm_86) stands in; allocated bytes do not "
                         "depend on the card's size", modelling=NEOX_4_42)
        for attn, b, s, mb in (("eager", 1, 1024, 4772.36), ("sdpa", 1, 1024, 2408.35),
                               ("eager", 2, 1024, 8707.55), ("sdpa", 2, 1024, 3878.86),
                               ("eager", 4, 512, 6290.58), ("sdpa", 4, 512, 3877.29))
    ),
    *(
        _script(f"distilbert-sdpa-{attn}-{b}x{s}", DISTIL_SDPA, "distilbert-base-uncased (DistilBertForMaskedLM)",
                distilbert_base, "masked-lm", b, s, attn, mb, "T4", DISTIL_VERSIONS,
                f"{EAGER_NOTE if attn == 'eager' else MEMEFF_NOTE}; {HELD_LOGITS}",
                gpu_note="RTX 2060 is not in gpus.py: T4 (sm_75) stands in; allocated bytes do not depend on the "
                         "card's size")
        for attn, b, s, mb in (("eager", 4, 256, 594.156), ("sdpa", 4, 256, 502.745),
                               ("eager", 8, 256, 983.450), ("sdpa", 8, 256, 798.480))
    ),
    _replay_2023("3090-vanilla", 4, 1, "fp32", "adamw_torch", False, 12852, "fp32, eager, AdamW per parameter"),
    _replay_2023("3090-accum", 1, 4, "fp32", "adamw_torch", False, 8590, "fp32, accumulation 4"),
    _replay_2023("3090-accum-gc", 1, 4, "fp32", "adamw_torch", True, 7078, "fp32, accumulation 4, checkpointing"),
    _replay_2023("3090-fp16", 4, 1, "fp16", "adamw_torch", False, 11224,
                 "torch.cuda.amp: CUDA's autocast lists (fp32 softmax and LayerNorm outputs) replayed"),
    _replay_2023("3090-adafactor", 4, 1, "fp32", "adafactor", False, 10440, "transformers' Adafactor"),
    _replay_2023("3090-accum8-bs8", 8, 8, "fp32", "adamw_torch", False, 20314,
                 "the notebook's second train() (after bs 1 x 4, the cache freed at its start)"),
    _replay_2023("3090-accum8-bs8-gc", 8, 8, "fp32", "adamw_torch", True, 8030,
                 "the notebook's second train() (after bs 1 x 4 with checkpointing, the cache freed at its start)"),
    _replay_2023("3090-accum-gc-fp16", 1, 4, "fp16", "adamw_torch", True, 7574,
                 "the notebook's second train() (after fp16 bs 4, the cache freed at its start)"),
    _replay_2023("3090-accum-gc-fp16-adafactor", 1, 4, "fp16", "adafactor", True, 5142,
                 "the notebook's second train() (after Adafactor bs 4, the cache freed at its start)"),
    _fms("fms-mistral-lora-bs4", 4, True, 29576, 26_704_571_904, "+0.06% (26,720,341,504 B)", "1,652 MiB"),
    _fms("fms-mistral-lora-bs8", 8, True, 43232, 38_742_912_512, "+0.04% (38,757,690,880 B)", "1,908 MiB"),
    _fms("fms-mistral-full-bs4", 4, False, 77256, 72_434_837_504, "-0.001% (72,434,223,104 B)"),
    _fms("fms-mistral-full-bs8", 8, False, 72988, 72_435_230_720, "-0.001% (72,434,616,320 B)"),
)


NOT_USED = (
    "- optimum-benchmark (github:huggingface/optimum-benchmark: the files of its whole history listed, sampled "
    "commits grepped): no committed training report with max_memory_reserved/max_memory_allocated. Its history holds example configs, TEI/CPU "
    "benchmark.json files with memory off, Llama-2 training CSVs with throughput only, and Llama inference CSVs "
    "(generate, 256 + 512 tokens). Its CI writes reports to Hugging Face Hub datasets, which are out of reach "
    "here, ROCm runs included. No ROCm figure is counted, and none would count as an independent CUDA source for "
    "device totals: HIP's caching allocator is CUDA's, hipified, but the hipBLAS workspace (pytorch#138791, "
    "before ROCm torch 2.6), the context and the kernels differ.",
    "- transformers docs/source/en/benchmarks.md (PyTorchBenchmark, TITAN RTX, torch 1.4): inference memory only "
    "(NVML after a forward, the context of that build unknown). Not a training step.",
    "- transformers model_memory_anatomy.md: the same 2022 V100 figures as [A]. Not independent.",
    "- mrabbah/llm-training, model-training-anatomy/mta.ipynb at commit 87207b9 (the guide's protocol on "
    "Felladrin/TinyMistral-248M-SFT-v4, seq-cls, 512 x 512, nvidia-smi after each train()): the card is not "
    "named (its text copies the guide's V100 sentence), torch and CUDA versions are not stated, the cells ran out "
    "of order in one kernel (execution counts 9 and 11 twice) with the model and cache carried from one train() "
    "to the next, and its fp16 runs log a loss of 0.0. Not fully specified: not used.",
    "- ClementBM/sandbox, finetune-llm/notebooks/gpu-memory.ipynb at commit 6b0621b (the guide rerun, "
    "torch >= 2.0 by its pyproject): it stops after loading the model (NVML 746 MiB after the first tensor, "
    "2,037 MiB with bert-large's weights); no train() figure, the card not named.",
    "- krishan's \"Bert Memory Consumption\" post (2019, pytorch_transformers on an 11.17 GiB card, Azure "
    "NC24sv3's stated V100 notwithstanding): torch.cuda.memory_allocated after forward passes only. Not a "
    "training step, not a device total.",
    "- discuss.huggingface.co/t/gpt-2-finetuning-peaks-at-8-gib-of-vram/172332 (GPT-2, 512-token blocks, the "
    "Trainer's defaults: batch 8; torch 2.9.1, transformers 4.57.3): the peak, \"8 GiB\", is read off a "
    "profiler plot of allocated memory and the card is not named. Not a device total.",
    "- [F]'s other single-GPU rows: gpt_bigcode-santacoder (full bf16, bs 4 15,116 MiB, bs 8 18,102 MiB) waits for "
    "its config.json and tokenizer's model_max_length (fms-hf-tuning caps max_seq_len there), not at hand offline; "
    "Mixtral-8x7B and Llama-2-70B did not fit one card (the CSV's figures are the card's limit); the "
    "foak-fast-kernels and bnb/GPTQ rows replace modules with fused Triton kernels or quantized ones this replay "
    "does not model.",
    "- Other reruns of the guide's notebook that the code index holds (an H100 host, a local Python 3.8 run, a "
    "Colab copy) come without the name of their repository: not citable, not used.",
)

LAZY_GAP = (
    "[E]'s device totals are 370-770 MiB over the prediction in every case. Its notebook measured the context "
    "right after its first tensor (656 MiB over the 620 MiB held before torch) under CUDA 11.7 with "
    "CUDA_MODULE_LOADING=LAZY (torch >= 1.13 sets it: pytorch/pytorch#86509), so the kernel images the "
    "training step loads afterwards (torch's elementwise, reduction, softmax and optimizer kernels, cuBLAS's "
    "GEMM kernels) are in the measured figure and in no predicted one. A published size for those images was "
    "looked for and not found: pytorch#86509 measures only the context after a first tensor (287,047,680 B "
    "lazy against 666,632,192 B eager, card not named); pytorch#107667 and #109888 (the maintainers: ~300-400 "
    "MB lazy, >1000 MB eager before 11.7) name no card or step; NVIDIA's Lazy Loading guide (CUDA Programming "
    "Guide 4.7) gives no sizes. The bound is documented: no more than the RTX 3090's eager context under CUDA "
    "11.1 (1,685 MiB, pytorch#55277; cuda_device.PUBLISHED_CONTEXTS) less the 656 MiB measured, 1,029 MiB, "
    "and every [E] gap is within it. So [E] stays explained, not modelled: no constant is fitted to it, and its "
    "cases keep their errors in the device-total line. [F]'s LoRA runs (CUDA 12.1, lazy by default since 12.2 "
    "and set by torch before) show the same sign at 1.65-1.91 GB with their allocation replayed to 0.06%: "
    "no published size of an A100's context under CUDA 12 or of flash-attn's sm_80 kernel images exists to "
    "model it with.",
)


# -- estimating one case --------------------------------------------------------------------------
def build_config(case: Case) -> Any:
    """The case's config with the attention implementation its run used."""
    config = case.config()
    config._attn_implementation = case.attn
    return config


def half_model(case: Case) -> torch.nn.Module:
    """The run's model on the meta device, loaded in its half precision (``torch_dtype``), its attention implementation."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[case.weights_dtype]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto_class(case.task).from_config(case.config(), dtype=dtype, attn_implementation=case.attn)


def logits_sum_model(case: Case) -> LogitsSum:
    """The script's model on the meta device: its dtype and attention implementation, :class:`LogitsSum`'s loss."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, None: torch.float32}[case.weights_dtype]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = auto_class(case.task).from_config(case.config(), dtype=dtype, attn_implementation=case.attn)
    presents = gpt_neox_4_42(inner, case.attn) if case.modelling == NEOX_4_42 else None
    return LogitsSum(inner, presents)


def run_estimate(case: Case, extrapolate: bool | None = False) -> Any:
    """``hf_memwatch.estimate`` of the case, on its CUDA card, with the settings its run used.

    ``extrapolate``: ``False`` (the comparison) replays every layer, so a gap is the replay's and not
    the depth extrapolation's (every model here takes seconds at full depth); ``None`` is the
    estimate's default (two short depths extrapolated), reported beside as a check of that shortcut.
    """
    common = dict(task=case.task, micro_batch_size=case.batch, seq_len=case.seq, device="cuda", gpu=case.gpu,
                  extrapolate_layers=extrapolate)
    if case.loop == "logits_sum":
        return estimate(logits_sum_model(case), precision=case.precision, optimizer_step=False, **common)
    replayed = {TRAINER_4_16: torch_1_10, TRAINER_4_30: per_parameter_adamw,
                LOSS_4_48: causal_lm_loss_4_48}.get(case.modelling, contextlib.nullcontext)
    model = build_config(case) if case.weights_dtype is None else half_model(case)
    if case.lora is not None:
        from hf_memwatch.estimation.peft import LoraSpec

        r, alpha, targets, dropout = case.lora
        common["lora"] = LoraSpec(r=r, alpha=alpha, targets=targets, dropout=dropout)
    with replayed():
        return estimate(model, precision=case.precision, optim=case.optim,
                        activation_checkpointing=case.checkpointing, gradient_accumulation_steps=case.accum, **common)


@dataclass
class Row:
    """One case's comparison: the like-for-like predicted figure, its basis and the error."""

    case: Case
    predicted: int | None
    basis: str
    error: float | None
    device_bytes: int | None
    peak_bytes: int | None
    reserved_bytes: int | None
    seconds: float
    failure: str = ""
    auto_peak: int | None = None  # the estimate's default (depth extrapolated where it applies)
    auto_reserved: int | None = None  # its peak reserved (the reserve carried from the deeper short depth)
    peak_phase: str = ""


def compare(case: Case, est: Any, seconds: float) -> Row:
    """The estimate's figure that is like the case's measured one, and the relative error."""
    if case.kind == "allocated":
        predicted, basis = est.peak_bytes, "peak allocated"
    elif case.kind == "reserved":
        predicted, basis = est.reserved_bytes, "peak reserved"
    elif case.context is not None and est.reserved_bytes is not None:
        predicted, basis = est.reserved_bytes + case.context, "reserved + the source's context"
    elif est.device_bytes is not None:
        predicted, basis = est.device_bytes, "device_bytes"
    else:
        predicted, basis = est.reserved_bytes, "reserved (context unknown)"
    error = None if predicted is None else (predicted - case.measured) / case.measured * 100
    return Row(case, predicted, basis, error, est.device_bytes, est.peak_bytes, est.reserved_bytes, seconds)


def evaluate(case: Case) -> Row:
    """Estimate one case and compare it; a failing estimate is a row saying why."""
    start = time.process_time()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = run_estimate(case)
            auto = run_estimate(case, extrapolate=None)
    except Exception as exc:  # reported in the table: a merge that breaks a case must show, not hide
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return Row(case, None, "", None, None, None, None, time.process_time() - start, f"{type(exc).__name__}: {first}")
    row = compare(case, est, time.process_time() - start)
    row.peak_phase = est.peak_phase
    if any(n.startswith("depth extrapolated") for n in auto.notes):
        row.auto_peak, row.auto_reserved = auto.peak_bytes, auto.reserved_bytes
    return row


# -- the report -----------------------------------------------------------------------------------
def _mb(nbytes: int | None, unit: int) -> str:
    return "–" if nbytes is None else f"{nbytes / unit:,.0f}"


def unit_of(case: Case) -> tuple[int, str]:
    """The unit the source printed: nvidia-smi's MiB, the scripts' MB (bytes x 1e-6)."""
    return (MiB, "MiB") if case.kind == "nvidia-smi" else (MB, "MB")


def configuration(case: Case) -> str:
    parts = [case.model, f"{case.batch} x {case.seq}"]
    parts.append(f"{case.weights_dtype} weights, no autocast" if case.weights_dtype else
                 {"fp32": "fp32", "fp16": "fp16 AMP", "bf16": "bf16 AMP"}[case.precision])
    parts.append(case.optim or "no optimizer (fwd+bwd)")
    if case.lora is not None:
        parts.append(f"LoRA r {case.lora[0]} on {'/'.join(t.removesuffix('_proj') for t in case.lora[2])}")
    if case.checkpointing:
        parts.append("grad. checkpointing")
    if case.accum > 1:
        parts.append(f"accum {case.accum}")
    parts.append(f"{case.attn} attention")
    parts.append(case.gpu + (f" (stand-in: {case.gpu_note})" if case.gpu_note else ""))
    return ", ".join(parts)


def explanation(case: Case) -> str:
    """The case's explanation with the protocol's computed terms filled in."""
    held = case.batch * case.seq * int(getattr(case.config(), "vocab_size", 0)) * 2  # fp16 logits
    return case.explanation.format(held=f"{held / MB:,.0f}")


def summary(rows: list[Row]) -> list[str]:
    errors = [abs(r.error) for r in rows if r.error is not None]
    if not errors:
        return ["No case could be compared."]
    worst = max((r for r in rows if r.error is not None), key=lambda r: abs(r.error))
    lines = [f"**{len(errors)} cases**, {len({r.case.source for r in rows})} sources: median |error| "
             f"**{statistics.median(errors):.1f}%**, worst **{worst.error:+.1f}%** (`{worst.case.key}`)."]
    for kind in KINDS:
        own = [abs(r.error) for r in rows if r.error is not None and r.case.kind == kind]
        if own:
            lines.append(f"- {kind}: {len(own)} cases, median |error| {statistics.median(own):.1f}%, "
                         f"worst {max(own):.1f}%")
    device = [r for r in rows if r.error is not None and r.case.kind in ("reserved", "nvidia-smi")]
    if device:
        lines.append(f"- device total (reserved or nvidia-smi): {len(device)} cases, "
                     f"{len({r.case.source for r in device})} sources, median |error| "
                     f"{statistics.median(abs(r.error) for r in device):.1f}%, worst "
                     f"{max((r.error for r in device), key=abs):+.1f}%")
    failed = [r for r in rows if r.failure]
    if failed:
        lines.append(f"- **{len(failed)} cases failed**: " + "; ".join(f"`{r.case.key}`: {r.failure}" for r in failed))
    return lines


def pairs(rows: list[Row]) -> list[str]:
    """Eager minus SDPA, measured and predicted: the attention's own cost, whatever the loss protocol."""
    by_key = {r.case.key: r for r in rows}
    lines = ["| pair | measured eager − sdpa (MB) | predicted eager − sdpa (MB) |", "|---|---:|---:|"]
    for key, row in by_key.items():
        twin = by_key.get(key.replace("-eager-", "-sdpa-"))
        if "-eager-" not in key or twin is None or row.predicted is None or twin.predicted is None:
            continue
        lines.append(f"| `{key.replace('-eager', '')}` | {(row.case.measured - twin.case.measured) / MB:,.0f} | "
                     f"{(row.predicted - twin.predicted) / MB:,.0f} |")
    return lines


def extrapolation(rows: list[Row]) -> list[str]:
    """The default estimate (short depths extrapolated) against the full-depth replay, per case: peak allocated
    and peak reserved (the extrapolated reserve carries the deeper short depth's gap: ``replay_reserve``)."""
    lines = ["| case | checkpointed | full depth peak allocated (B) | extrapolated | full depth peak reserved (B) | "
             "extrapolated | reserved difference |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.auto_peak is not None and r.peak_bytes:
            reserved = "–" if not r.reserved_bytes or r.auto_reserved is None else \
                f"{(r.auto_reserved - r.reserved_bytes) / r.reserved_bytes * 100:+.2f}%"
            lines.append(f"| `{r.case.key}` | {'yes' if r.case.checkpointing else ''} | {r.peak_bytes:,} | "
                         f"{_same(r.auto_peak, r.peak_bytes)} | {_mb(r.reserved_bytes, 1)} | "
                         f"{_same(r.auto_reserved, r.reserved_bytes)} | {reserved} |")
    return lines


def _same(value: int | None, full: int | None) -> str:
    return "–" if value is None else "equal" if value == full else f"{value:,}"


def _commit() -> str:
    """HEAD's short hash, ``+changes`` where the tree differs from it (the benchmark or the library edited)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+changes" if git("status", "--porcelain", "--", "hf_memwatch", "benchmarks/cuda_published.py")
                       else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report(rows: list[Row], wall: float) -> list[str]:
    lines = [
        "# The CUDA estimate against published GPU measurements",
        "",
        f"`python benchmarks/cuda_published.py --out benchmarks/results/cuda_published.md` at commit {_commit()} "
        f"(torch {torch.__version__}, transformers {transformers.__version__}, {platform.machine()}); "
        f"{len(rows)} estimates in {wall:.0f} s wall, {sum(r.seconds for r in rows):.0f} CPU s. Measurements "
        "from sources nobody here tuned on; settings per case as their versions ran (see `CASES` in the "
        "script). Error = (predicted − measured) / measured.",
        "",
        *summary(rows),
        "",
        "| case | source | configuration | measured | kind | predicted | basis | error | peak phase | device_bytes "
        "| explanation |",
        "|---|---|---|---:|---|---:|---|---:|---|---:|---|",
    ]
    labels = {source: f"[{chr(ord('A') + i)}]" for i, source in enumerate(dict.fromkeys(r.case.source for r in rows))}
    for r in rows:
        unit, name = unit_of(r.case)
        error = f"{r.error:+.1f}%" if r.error is not None else (f"failed: {r.failure}" if r.failure else "–")
        lines.append(f"| `{r.case.key}` | {labels[r.case.source]} | {configuration(r.case)} | "
                     f"{_mb(r.case.measured, unit)} {name} | {r.case.kind} | {_mb(r.predicted, unit)} {name} | "
                     f"{r.basis} | {error} | {r.peak_phase} | {_mb(r.device_bytes, unit)} | {explanation(r.case)} |")
    lines += ["", "## Sources, their versions and the settings passed", ""]
    for source, label in labels.items():
        case = next(r.case for r in rows if r.case.source == source)
        lines.append(f"- {label} {source}: {case.versions}. {case.settings}.")
    lines += ["", "## Sources looked for and not used", "", *NOT_USED]
    lines += ["", "## The lazy-loading gap ([E])", "", *LAZY_GAP]
    lines += ["", "## Eager minus SDPA (same script, same loss: the attention path alone)", "", *pairs(rows)]
    lines += ["", "## The default estimate's depth extrapolation against the full-depth replay", "",
              "The table above replays every layer (`extrapolate_layers=False`); `estimate()`'s default "
              "simulates two short depths (a checkpointed run 3 and 4 layers, its backward per recomputed layer) and "
              "extrapolates:", "",
              *extrapolation(rows)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", default=None, help="run the cases whose key contains this text")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = []
    for case in CASES:
        if args.only and args.only not in case.key:
            continue
        row = evaluate(case)
        rows.append(row)
        unit, name = unit_of(case)
        print(f"{case.key}: measured {_mb(case.measured, unit)} {name}, predicted {_mb(row.predicted, unit)} {name} "
              f"({row.basis}, {row.peak_phase}) "
              f"{'' if row.error is None else f'{row.error:+.1f}%'} {row.failure} [{row.seconds:.1f} CPU s]",
              flush=True)
    text = "\n".join(report(rows, time.perf_counter() - start)) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 1 if any(r.failure for r in rows) else 0


if __name__ == "__main__":
    torch.set_num_threads(1)  # the CPU cost as one core pays it (a shared machine)
    transformers.logging.set_verbosity_error()
    sys.exit(main())
