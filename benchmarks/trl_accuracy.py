"""``hf_memwatch.estimate(trainer)`` on the fine-tunes people run: TRL SFT (full, LoRA, QLoRA) and DPO.

Each case builds the TRL trainer, estimates its step by replaying the trainer's own
``training_step`` on fake tensors, then trains 2 real steps under the profiler (PyTorch's own CPU
memory events, :mod:`hf_memwatch.testing.truth`) and compares the peaks. Samples all have the same
length, so every batch is the worst case the estimate plans for. QLoRA: the base is saved and loaded
back through ``BitsAndBytesConfig`` (4-bit nf4; bitsandbytes quantizes on the CPU), then handed to
the SFTTrainer with a LoRA ``peft_config``.

Usage:
    .venv/bin/python benchmarks/trl_accuracy.py            # writes benchmarks/results/trl_accuracy.md
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from hf_memwatch.testing.tokenizers import word_tokenizer
from hf_memwatch.testing.trainers import masking_trainer

RESULTS = Path(__file__).parent / "results" / "trl_accuracy.md"
ONLINE = ("grpo", "gmpo", "rloo", "onlinedpo", "gkd", "sdft", "sdpo")  # trainers that generate inside their step


def model(family: str, seed: int = 0) -> Any:
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=1002, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**common)
    return transformers.AutoModelForCausalLM.from_config(config)


def quantized(family: str, out: str) -> Any:
    """``model(family)`` saved and loaded back 4-bit (nf4) as ``BitsAndBytesConfig`` loads it."""
    import transformers

    path = Path(out) / "base"
    model(family).save_pretrained(path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu")


def words(generator: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 1000, (n,), generator=generator))


def reward_model(family: str, seed: int = 2, hidden: int = 32, layers: int = 1) -> Any:
    """A one-label sequence-classification model of ``family`` (a reward model, random weights)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=1002, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 16, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=1000, eos_token_id=1001,
                  num_labels=1)
    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family](**common)
    return transformers.AutoModelForSequenceClassification.from_config(config)


def reward_length(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward as a Python callable: the completion's length in characters."""
    return [float(len(str(c))) for c in completions]


def policy(family: str, out: str, saved: bool) -> Any:
    """``model(family)``, or (``saved``) the folder it is saved in: GRPO and RLOO with ``beta > 0`` load the
    reference model from the policy's ``name_or_path``."""
    built = model(family)
    if not saved:
        return built
    built.save_pretrained(Path(out) / "policy")
    return str(Path(out) / "policy")


def build_online(kind: str, family: str, out: str, common: dict[str, Any], generator: torch.Generator) -> Any:
    """GRPO, RLOO (reward: a callable, or a callable and a reward model), Online DPO (a reward model), GKD."""
    from datasets import Dataset

    common = {k: v for k, v in common.items() if k not in ("max_length",)}
    prompts = Dataset.from_list([{"prompt": words(generator, 12)} for _ in range(16)])
    tokenizer = word_tokenizer()
    rewards: list[Any] = [reward_length] + ([reward_model(family)] if "-rm" in kind else [])
    online = dict(common, per_device_train_batch_size=4, max_completion_length=8)
    if kind.startswith("grpo"):
        from trl import GRPOConfig, GRPOTrainer

        with_reference = "-ref" in kind
        return GRPOTrainer(model=policy(family, out, with_reference or "-path" in kind), reward_funcs=rewards, train_dataset=prompts,
                           processing_class=tokenizer,
                           args=GRPOConfig(**online, num_generations=4, beta=0.04 if with_reference else 0.0),
                           reward_processing_classes=[None, tokenizer][:len(rewards)])
    if kind == "gmpo":
        from trl.experimental.gmpo import GMPOConfig, GMPOTrainer

        return GMPOTrainer(model=policy(family, out, False), reward_funcs=rewards, train_dataset=prompts,
                           processing_class=tokenizer, args=GMPOConfig(**online, num_generations=4))
    if kind.startswith("rloo"):
        from trl import RLOOConfig, RLOOTrainer

        return RLOOTrainer(model=policy(family, out, True), reward_funcs=rewards, train_dataset=prompts, processing_class=tokenizer,
                           args=RLOOConfig(**online, num_generations=2),
                           reward_processing_classes=[None, tokenizer][:len(rewards)])
    if kind == "onlinedpo":
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        config = OnlineDPOConfig(**{k: v for k, v in online.items() if k != "max_completion_length"}, max_new_tokens=8)
        return OnlineDPOTrainer(model=model(family), ref_model=model(family, seed=1), reward_funcs=[reward_model(family)],
                                args=config, train_dataset=prompts, processing_class=tokenizer,
                                reward_processing_classes=[tokenizer])
    if kind == "gkd":
        return gkd(family, online, generator)
    if kind.startswith(("sdft", "sdpo")):
        return self_distillation(kind, family, online, generator)
    raise ValueError(kind)


def self_distillation(kind: str, family: str, online: dict[str, Any], generator: torch.Generator) -> Any:
    """TRL's experimental SDFT and SDPO: GRPO's generation loop (4 completions per prompt), the trained model
    as its own "live" teacher on the prompt plus a privileged context; SDPO adds a Python reward. ``-2x2``:
    micro-batch 2 x accumulation 2 (the generation batch of 4 split across the micro-steps)."""
    from datasets import Dataset

    contexts = Dataset.from_list([{"prompt": words(generator, 12), "privileged_context": words(generator, 12)}
                                  for _ in range(16)])
    args = dict(online, num_generations=4, teacher_model_kind="live")
    if kind.endswith("-2x2"):
        args.update(per_device_train_batch_size=2, gradient_accumulation_steps=2)
    if kind.startswith("sdft"):
        from trl.experimental.sdft import SDFTConfig, SDFTTrainer

        return SDFTTrainer(model=model(family), args=SDFTConfig(**args), train_dataset=contexts,
                           processing_class=word_tokenizer())
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer

    return SDPOTrainer(model=model(family), reward_funcs=[reward_length], args=SDPOConfig(**args),
                       train_dataset=contexts, processing_class=word_tokenizer())


CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def gkd(family: str, online: dict[str, Any], generator: torch.Generator, **overrides: Any) -> Any:
    """TRL's experimental GKDTrainer: a student, a teacher (another seed of ``family``), conversations of a
    12-word prompt and a 4-word answer; ``lmbda=0.5`` (on-policy generation of ``max_new_tokens=8`` drawn
    per step, the replay's worst case: prompt + 8 is longer than prompt + answer)."""
    from datasets import Dataset
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    tokenizer = word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    data = Dataset.from_list([{"messages": [{"role": "user", "content": words(generator, 12)},
                                            {"role": "assistant", "content": words(generator, 4)}]}
                              for _ in range(16)])
    values = {k: v for k, v in online.items() if k != "max_completion_length"}
    values.update(dict(max_new_tokens=8, lmbda=0.5, max_length=64), **overrides)
    return GKDTrainer(model=model(family), teacher_model=model(family, seed=1), args=GKDConfig(**values),
                      train_dataset=data, processing_class=tokenizer)


OFFLINE = ("reward", "kto", "cpo", "orpo", "tpo", "distillation", "custom")


def build_offline(kind: str, family: str, out: str, common: dict[str, Any], generator: torch.Generator) -> Any:
    """RewardTrainer (a sequence-classification model on chosen/rejected pairs), KTO (a reference model,
    desirable/undesirable completions), TRL's experimental CPO and ORPO (no reference model), and
    DistillationTrainer (a teacher; the student generates its completions on-policy)."""
    from datasets import Dataset

    tokenizer = word_tokenizer()
    pairs = Dataset.from_list([{"prompt": words(generator, 20), "chosen": words(generator, 20),
                                "rejected": words(generator, 20)} for _ in range(32)])
    small = dict(common, per_device_train_batch_size=4)
    if kind == "reward":
        from trl import RewardConfig, RewardTrainer

        return RewardTrainer(model=reward_model(family, hidden=64, layers=2), args=RewardConfig(**small),
                             train_dataset=pairs, processing_class=tokenizer)
    if kind == "kto":
        from trl import KTOConfig, KTOTrainer

        data = Dataset.from_list([{"prompt": words(generator, 24), "completion": words(generator, 24),
                                   "label": bool(i % 2)} for i in range(32)])
        return KTOTrainer(model=model(family), ref_model=model(family, seed=1), args=KTOConfig(**small),
                          train_dataset=data, processing_class=tokenizer)
    if kind == "cpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return CPOTrainer(model=model(family), args=CPOConfig(**small), train_dataset=pairs,
                          processing_class=tokenizer)
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer(model=model(family), args=ORPOConfig(**small), train_dataset=pairs,
                           processing_class=tokenizer)
    if kind == "distillation":
        from trl import DistillationConfig, DistillationTrainer

        data = Dataset.from_list([{"prompt": words(generator, 12)} for _ in range(16)])
        values = {k: v for k, v in small.items() if k != "max_length"}
        return DistillationTrainer(model=model(family), teacher_model=model(family, seed=1),
                                   args=DistillationConfig(**values, max_completion_length=8), train_dataset=data,
                                   processing_class=tokenizer)
    if kind == "custom":
        from transformers import TrainingArguments

        data = Dataset.from_list([{"input_ids": ids, "labels": ids} for ids in
                                  (torch.randint(0, 1000, (48,), generator=generator).tolist() for _ in range(32))])
        values = {k: v for k, v in small.items() if k not in ("max_length", "activation_checkpointing")}
        return masking_trainer()(model=model(family), args=TrainingArguments(**values), train_dataset=data)
    if kind == "tpo":
        from trl.experimental.tpo import TPOConfig, TPOTrainer

        data = Dataset.from_list([{"prompt": words(generator, 20), "chosen": words(generator, 20),
                                   "rejected": words(generator, 20), "reference": words(generator, 20)}
                                  for _ in range(32)])
        return TPOTrainer(model=model(family), args=TPOConfig(**small), train_dataset=data, processing_class=tokenizer)
    raise ValueError(kind)


def build(kind: str, family: str, out: str, precision: str, checkpointing: bool) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    common = dict(output_dir=out, per_device_train_batch_size=8, max_steps=2, logging_steps=1, report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=precision == "bf16",
                  activation_checkpointing=checkpointing, max_length=64, dataloader_num_workers=0)
    if kind.split("-")[0] in ONLINE:
        return build_online(kind, family, out, common, generator)
    if kind.startswith("sft"):
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_list([{"input_ids": torch.randint(0, 1000, (48,), generator=generator).tolist()}
                                  for _ in range(32)])
        peft_config = None
        if kind in ("sft-lora", "sft-qlora"):
            from peft import LoraConfig

            targets = "all-linear" if kind == "sft-qlora" else ["q_proj", "v_proj"]
            peft_config = LoraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM")
        base = quantized(family, out) if kind == "sft-qlora" else model(family)
        return SFTTrainer(model=base, args=SFTConfig(**common), train_dataset=data,
                          processing_class=word_tokenizer(), peft_config=peft_config)
    if kind in OFFLINE:
        return build_offline(kind, family, out, common, generator)
    from trl import DPOConfig, DPOTrainer

    data = Dataset.from_list([{"prompt": words(generator, 20), "chosen": words(generator, 20),
                               "rejected": words(generator, 20)} for _ in range(32)])
    args = DPOConfig(**{**common, "per_device_train_batch_size": 4},
                     precompute_ref_log_probs=kind == "dpo-precomputed")
    return DPOTrainer(model=model(family), ref_model=model(family, seed=1), args=args, train_dataset=data,
                      processing_class=word_tokenizer())


def measure(kind: str, family: str, precision: str, checkpointing: bool) -> dict[str, Any]:
    from hf_memwatch import estimate
    from hf_memwatch.measure.attribution import weight_storages
    from hf_memwatch.measure.held_models import held_models
    from hf_memwatch.testing.truth import cpu_memory_profile, window_peak

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = build(kind, family, out, precision, checkpointing)
        started = time.perf_counter()
        predicted = estimate(trainer).peak_bytes
        seconds = time.perf_counter() - started
        resident = dict(weight_storages(trainer.model, None))
        for module in held_models(trainer).values():
            resident.update(weight_storages(module, None))
        with cpu_memory_profile() as prof:
            trainer.train()
        truth = window_peak(prof, sum(resident.values()))
    return {"kind": kind, "family": family, "precision": precision, "checkpointing": checkpointing,
            "truth": truth, "estimate": predicted, "error": (predicted - truth) / truth, "seconds": seconds}


CASES = [(kind, family, precision, ckpt)
         for family in ("llama", "qwen2")
         for kind, precision, ckpt in (("sft-full", "fp32", False), ("sft-full", "bf16", True),
                                       ("sft-lora", "fp32", True), ("sft-lora", "bf16", False),
                                       ("sft-qlora", "fp32", True), ("sft-qlora", "bf16", False),
                                       ("dpo", "fp32", False), ("dpo-precomputed", "bf16", False),
                                       ("grpo", "fp32", False), ("grpo-rm-ref", "fp32", False),
                                       ("rloo", "fp32", False), ("rloo-rm", "fp32", False),
                                       ("onlinedpo", "fp32", False), ("gkd", "fp32", False),
                                       ("gkd", "fp32", True), ("reward", "fp32", False), ("kto", "fp32", False),
                                       ("cpo", "fp32", False), ("orpo", "bf16", False), ("tpo", "fp32", False),
                                       ("gmpo", "fp32", False), ("distillation", "fp32", False),
                                       ("sdft", "fp32", False), ("sdft-2x2", "fp32", False),
                                       ("sdpo", "fp32", False), ("sdpo-2x2", "fp32", False),
                                       ("custom", "fp32", False))]


def kept_rows(kinds: set[str]) -> list[dict[str, Any]]:
    """The rows of the committed table whose trainer is not in ``kinds`` (``--only``: measure a few, keep the rest)."""
    rows = []
    for line in RESULTS.read_text().splitlines() if RESULTS.exists() else []:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 8 or not cells[4].replace(",", "").isdigit() or cells[0] in kinds:
            continue
        truth, predicted = int(cells[4].replace(",", "")), int(cells[5].replace(",", ""))
        rows.append({"kind": cells[0], "family": cells[1], "precision": cells[2], "checkpointing": cells[3] == "on",
                     "truth": truth, "estimate": predicted, "error": (predicted - truth) / truth,
                     "seconds": float(cells[7].split()[0])})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--only", nargs="*", default=None,
                        help="measure only these trainer kinds; the committed table's other rows are kept")
    args = parser.parse_args()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # the optional CPU kernel package's notice
    started = time.perf_counter()
    only = set(args.only) if args.only else None
    measured = [measure(*case) for case in CASES if only is None or case[0] in only]
    kept = kept_rows(only) if only else []
    order = {case: index for index, case in enumerate(CASES)}
    rows = sorted(measured + kept, key=lambda r: order.get(
        (r["kind"], r["family"], r["precision"], r["checkpointing"]), len(order)))
    errors = [abs(r["error"]) for r in rows]
    lines = [
        "# hf-memwatch estimate(trainer) on TRL trainers: accuracy",
        "",
        f"Generated by `benchmarks/trl_accuracy.py` in {time.perf_counter() - started:.0f} s (torch {torch.__version__}, "
        f"2 CPUs{'; rows of ' + ', '.join(sorted(only)) + ' measured, the others kept from the previous run' if only else ''}). Estimate: the trainer's own training_step replayed on fake tensors; truth: the profiler's CPU "
        "memory events of 2 real steps (resident weights of every model the trainer holds as the baseline).",
        "",
        f"{len(rows)} cases over 2 architectures. Peak error, absolute relative: **median "
        f"{100 * statistics.median(errors):.3f}%, worst {100 * max(errors):.3f}%**.",
        "",
        "| trainer | model | precision | ckpt | truth (bytes) | estimate (bytes) | error | estimate time |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['family']} | {r['precision']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{r['truth']:,} | {r['estimate']:,} | {100 * r['error']:+.3f}% | {r['seconds']:.2f} s |")
    lines += ["", "grpo / rloo: 4 prompts x `num_generations` completions of `max_completion_length`=8 tokens generated "
              "inside the step (the replay generates each to its longest); reward: a Python callable, `-rm` adds a "
              "1-layer sequence-classification reward model in `reward_funcs`, `-ref` a reference model (`beta` > 0; "
              "RLOO's default beta has one). onlinedpo: TRL's experimental OnlineDPOTrainer, 2 completions of 8 tokens per "
              "prompt scored by a reward model in `reward_funcs`, with a reference model. gkd: TRL's experimental GKDTrainer, a "
              "teacher of the same architecture, `lmbda=0.5` (the replay generates on-policy every step, "
              "`max_new_tokens`=8: the worst case). reward: RewardTrainer on a 2-layer one-label classifier (chosen and "
              "rejected in one batch); kto: a reference model, desirable/undesirable completions; cpo, orpo, tpo: TRL's "
              "experimental trainers (no reference model; tpo adds a reference completion); gmpo: the experimental GRPO "
              "variant (a Python reward and a reward model); distillation: DistillationTrainer, a teacher, the student "
              "generates 8 tokens per prompt on-policy. sdft, sdpo: TRL's experimental self-distillation trainers (4 completions "
              "of 8 tokens per prompt, the trained model as its own teacher on the prompt plus a privileged context; sdpo "
              "adds a Python reward), `-2x2`: micro-batch 2 x accumulation 2. custom: a plain `Trainer` subclass with its own "
              "`_prepare_inputs` (15% of the tokens masked) and `compute_loss` (LM loss + a penalty on every layer's "
              "hidden states), replayed as written. TRL 1.16 ships no PRM, Nash-MD, XPO or BCO trainer.", "", "sft-qlora: a 4-bit nf4 base (loaded through `BitsAndBytesConfig`) + LoRA on all linears. QLoRA "
              "from a config (`--load-in-4bit`, 8-bit, double quantization, fp4): `peft_accuracy.md`."]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
