"""``hf-memwatch estimate MODEL``: predict a Trainer step's peak memory without running it.

MODEL is a local model directory or ``config.json`` (a hub id where the network allows). The
default output is a table — each class in bytes and share of the peak, the phase of the peak — and,
with ``--budget``, whether it fits, and the planning core's answer (one
:class:`~hf_memwatch.planning.chooser.PlanRequest`, the auto mode's chooser): the plan, and the
predicted peak of each remedy setting (checkpointing, 8-bit AdamW, both) with the largest
micro-batch of the same effective batch that fits. ``--json`` prints one object instead.

Usage:
    hf-memwatch estimate ./my-model --micro-batch-size 16 --seq-len 512 --precision bf16 --budget 24GiB
    hf-memwatch estimate ./my-model --lora-r 16 --lora-targets all-linear --precision bf16
    hf-memwatch estimate --adapter ./my-adapter --micro-batch-size 8 --json
    hf-memwatch estimate ./my-model --load-in-4bit --double-quant --lora-r 16 --lora-targets all-linear
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import TYPE_CHECKING, Any

from ..core.categories import ESTIMATE_CLASSES
from ..core.choices import COMPUTE_DTYPE_NAMES, DEVICES, PRECISIONS, QUANT_TYPES, SHARDS, TASKS, check_path
from ..core.errors import MemWatchConfigError
from ..core.extras import require
from ..core.gpus import DEFAULT_GPU, GPUS, gpu_spec
from ..core.optimizers import SUPPORTED_OPTIMS
from ..core.renamed import RenamedFlag, RenamedKeys, RenamedSwitch
from ..core.units import format_bytes, parse_bytes
from .figures import (
    CUDA_MEANINGS,
    add_cuda_rows,
    add_figure_arguments,
    budget_line,
    card_fit_line,
    peak_line,
    readable_config,
    remedy_cells,
    remedy_columns,
    removes_line,
    subject_of,
    tensors_scope,
    weights_dtype,
    weights_line,
)

# Light imports only (no torch, no transformers): the arguments are checked (check_arguments) before
# anything heavy is imported; the estimator, planner and their types are imported where used.
if TYPE_CHECKING:
    from ..core.run_config import RunConfig
    from ..measure.peak_tensors import PeakTensors
    from ..planning.chooser import PlanRequest

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``hf-memwatch estimate``."""
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None,
                        help="local model directory or config.json (or a hub id); with --adapter, the base "
                             "(default: the adapter's base_model_name_or_path)")
    parser.add_argument("--task", choices=TASKS, default=None, help="default: from the config's architectures")
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="per-device micro-batch, per_device_train_batch_size (default 8)")
    parser.add_argument("--batch-size", dest="micro_batch_size", type=int, action=RenamedFlag,
                        new="--micro-batch-size")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sample (default 512)")
    parser.add_argument("--target-len", type=int, default=None, help="seq2seq label length (default: --seq-len)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="fp32, or bf16/fp16 mixed precision as the Trainer runs it")
    parser.add_argument("--optim", default=None,
                        help=f"TrainingArguments.optim name: {', '.join(SUPPORTED_OPTIMS)} (default adamw_torch; "
                             "with --device cuda the Trainer's own default, adamw_torch_fused on torch >= 2.8)")
    parser.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                        help="activation (gradient) checkpointing (default: off; on with --load-in-4bit/--load-in-8bit, "
                             "as prepare_model_for_kbit_training turns it on: --no-activation-checkpointing for "
                             "without)")
    parser.add_argument("--checkpointing", dest="activation_checkpointing", action=RenamedSwitch,
                        new="--activation-checkpointing")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1,
                        help="gradient accumulation steps (default 1)")
    parser.add_argument("--accum", dest="gradient_accumulation_steps", type=int, action=RenamedFlag,
                        new="--gradient-accumulation-steps")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="the target device (default cpu)")
    parser.add_argument("--gpu", default=None, metavar="NAME",
                        help=f"the CUDA target's card (with --device cuda): {', '.join(s.name for s in GPUS)} "
                             f"(default: this machine's card, else {DEFAULT_GPU}); without --budget, fits is "
                             "judged against its memory")
    parser.add_argument("--budget", default=None, help="memory budget per device, e.g. 24GiB")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    parser.add_argument("--shard", choices=SHARDS, default="none", help="ZeRO stage or FSDP full shard")
    parser.add_argument("--offload", choices=("none", "optimizer", "params"), default="none",
                        help="DeepSpeed ZeRO offload to host RAM (zero1/2/3; params: zero3 only)")
    parser.add_argument("--reduce-bucket-size", type=float, default=None,
                        help="DeepSpeed reduce_bucket_size in elements (default DeepSpeed's 5e8)")
    parser.add_argument("--prefetch-bucket-size", type=float, default=None,
                        help="DeepSpeed stage3_prefetch_bucket_size in elements (default 5e7)")
    parser.add_argument("--max-live-parameters", type=float, default=None,
                        help="DeepSpeed stage3_max_live_parameters in elements (default 1e9)")
    parser.add_argument("--max-reuse-distance", type=float, default=None,
                        help="DeepSpeed stage3_max_reuse_distance in elements (default 1e9)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--top", type=int, default=0, metavar="N",
                        help="list the N largest tensors alive at the predicted peak, by module and operator; "
                             "with --budget, what each remedy removes")
    add_peft_arguments(parser)
    add_eval_arguments(parser)
    add_figure_arguments(parser)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the evaluation loop's estimate (``eval_peak_bytes``, ``eval_peak_phase``, ``eval_classes``)."""
    group = parser.add_argument_group("evaluation loop (Trainer.evaluate / predict)")
    group.add_argument("--eval-batch-size", type=int, default=None, help="per_device_eval_batch_size")
    group.add_argument("--eval-samples", type=int, default=None, help="examples in the eval dataset")
    group.add_argument("--eval-accumulation-steps", type=int, default=None,
                       help="eval_accumulation_steps (default: outputs stay on the device until the end)")
    group.add_argument("--eval-seq-len", type=int, default=None, help="tokens per eval sample (default: --seq-len)")
    group.add_argument("--prediction-loss-only", action="store_true", help="keep only the loss (no logits, labels)")
    group.add_argument("--predict-with-generate", action="store_true",
                       help="Seq2SeqTrainer's generation-based prediction (every sequence to the max length)")
    group.add_argument("--generation-max-length", type=int, default=None,
                       help="generation_max_length (default: the model's generation config, else 20)")
    group.add_argument("--generation-num-beams", type=int, default=None,
                       help="generation_num_beams (default: the model's generation config, else 1)")


def check_arguments(args: argparse.Namespace) -> None:
    """Reject bad arguments before anything heavy is imported (torch, transformers: seconds), each with
    one actionable line (:class:`MemWatchConfigError`); the estimate's own checks follow."""
    for flag in ("micro_batch_size", "seq_len", "gradient_accumulation_steps", "world_size"):
        if getattr(args, flag) < 1:
            raise MemWatchConfigError(f"--{flag.replace('_', '-')} must be at least 1; got {getattr(args, flag)}")
    if args.top < 0:
        raise MemWatchConfigError(f"--top must be >= 0; got {args.top}")
    if args.budget is not None:
        check_budget(args.budget)
    if args.gpu is not None:
        gpu_kwargs(args)  # an unknown card, or a card for a CPU target: one line, before the imports
    if args.model is None and args.adapter is None:
        raise MemWatchConfigError("give MODEL: a model folder or its config.json (or a hub id), or --adapter DIR")
    for given in (args.model, args.adapter):  # a missing path: at once, not after 5-50 s of imports
        check_path(given)
    if args.lora_r is None and ((args.lora_alpha, args.lora_targets) != (None, None) or args.lora_dropout):
        raise MemWatchConfigError("--lora-alpha/--lora-targets/--lora-dropout need --lora-r")
    four_bit_options = (args.bnb_4bit_quant_type, args.bnb_4bit_compute_dtype) != (None, None) or args.double_quant
    if four_bit_options and not args.load_in_4bit:
        raise MemWatchConfigError("--bnb-4bit-quant-type/--double-quant/--bnb-4bit-compute-dtype need --load-in-4bit")
    if (args.load_in_4bit or args.load_in_8bit) and args.lora_r is None and args.adapter is None:
        raise MemWatchConfigError("a quantized base is frozen, only adapters train on it (QLoRA): add --lora-r 16 "
                                  "--lora-targets all-linear, or --adapter DIR")
    if args.lora_r is not None or args.adapter is not None:
        require("peft", "--lora-r/--adapter (LoRA estimates)")
    if args.load_in_4bit or args.load_in_8bit:
        require("bitsandbytes", f"--load-in-{4 if args.load_in_4bit else 8}bit (a quantized base)")


def check_budget(text: str) -> None:
    """``--budget``: a size; a fraction (``0.8``) is refused with the way to say it in bytes (the command
    knows no device's capacity)."""
    try:
        parse_bytes(text, what="--budget")
    except MemWatchConfigError as exc:
        if "fraction" in str(exc) and "needs a known device capacity" in str(exc):
            raise MemWatchConfigError(
                f"--budget {text} is a fraction of a device's memory, which the estimate does not know: give the "
                "size, e.g. --budget 24GiB (80% of a 30 GiB card: --budget 24GiB)") from None
        raise


def eval_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``estimate()`` keywords of the evaluation options (empty without ``--eval-batch-size``)."""
    if args.eval_batch_size is None and args.eval_samples is None:
        if args.predict_with_generate or args.generation_max_length or args.generation_num_beams:
            raise MemWatchConfigError("--predict-with-generate/--generation-* need --eval-batch-size and --eval-samples")
        return {}
    return dict(eval_batch_size=args.eval_batch_size, eval_samples=args.eval_samples,
                eval_accumulation_steps=args.eval_accumulation_steps, eval_seq_len=args.eval_seq_len,
                prediction_loss_only=args.prediction_loss_only, predict_with_generate=args.predict_with_generate,
                generation_max_length=args.generation_max_length, generation_num_beams=args.generation_num_beams)


def print_eval(payload: dict[str, Any], console: Any) -> None:
    """The evaluation loop's predicted peak and split, when it was asked for."""
    peak = payload.get("eval_peak_bytes")
    if peak is None:
        return
    from rich.table import Table

    table = Table(title=f"evaluation loop · peak at {payload['eval_peak_phase']}")
    table.add_column("class")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    for name, value in payload["eval_classes"].items():
        table.add_row(name, f"{value:,}", format_bytes(value))
    table.add_row("eval peak", f"{peak:,}", format_bytes(peak), style="bold")
    console.print(table)


def add_peft_arguments(parser: argparse.ArgumentParser) -> None:
    """``--lora-*`` (a new LoRA adapter on MODEL) and ``--adapter DIR`` (a saved PEFT adapter)."""
    group = parser.add_argument_group("PEFT (LoRA)")
    group.add_argument("--lora-r", type=int, default=None, help="train a LoRA adapter of this rank (base frozen)")
    group.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: PEFT's, 8)")
    group.add_argument("--lora-targets", default=None,
                       help="comma-separated module names (q_proj,v_proj) or all-linear (default: PEFT's)")
    group.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout (default 0)")
    group.add_argument("--adapter", default=None, metavar="DIR",
                       help="a saved PEFT adapter folder (adapter_config.json), trained further")
    quant = parser.add_argument_group("quantized base (QLoRA), as BitsAndBytesConfig loads it")
    bits = quant.add_mutually_exclusive_group()
    bits.add_argument("--load-in-4bit", action="store_true", help="4-bit bitsandbytes base (load_in_4bit)")
    bits.add_argument("--load-in-8bit", action="store_true", help="8-bit bitsandbytes base (load_in_8bit)")
    quant.add_argument("--bnb-4bit-quant-type", choices=QUANT_TYPES, default=None,
                       help="bnb_4bit_quant_type (default nf4)")
    quant.add_argument("--double-quant", action="store_true", help="bnb_4bit_use_double_quant")
    quant.add_argument("--bnb-4bit-compute-dtype", choices=COMPUTE_DTYPE_NAMES, default=None,
                       help="bnb_4bit_compute_dtype (default fp32)")


def peft_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``lora``/``adapter`` keywords of :func:`estimate` from the CLI options (checked by
    :func:`check_arguments`)."""
    from ..estimation.peft import LoraSpec

    lora = None if args.lora_r is None else LoraSpec.from_targets_text(args.lora_r, args.lora_alpha,
                                                                        args.lora_targets, args.lora_dropout)
    return dict(lora=lora, adapter=args.adapter, quantization=quantization(args))


def quantization(args: argparse.Namespace) -> Any:
    """The :class:`~hf_memwatch.estimation.quantized.QuantSpec` of ``--load-in-4bit``/``--load-in-8bit``
    (None without them; the flags checked by :func:`check_arguments`)."""
    from ..estimation.quantized import QuantSpec

    if not args.load_in_4bit:
        return QuantSpec(bits=8) if args.load_in_8bit else None
    return QuantSpec(bits=4, quant_type=args.bnb_4bit_quant_type or "nf4", double_quant=args.double_quant,
                     compute_dtype=args.bnb_4bit_compute_dtype or "fp32")


def checkpointing_of(args: argparse.Namespace) -> bool:
    """``--activation-checkpointing``/``--no-activation-checkpointing`` when given; otherwise on for a quantized base, as
    PEFT's ``prepare_model_for_kbit_training`` (``use_gradient_checkpointing=True`` by default) leaves it
    (measured, tiny 4-bit Llama + LoRA, bf16, 2 x 64 tokens, tests/test_qlora.py: the prepared run peaks at
    2,540,492 B; estimated -0.32% with checkpointing, +33.14% without)."""
    if args.activation_checkpointing is not None:
        return bool(args.activation_checkpointing)
    return bool(getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False))


def _run_config(args: argparse.Namespace) -> RunConfig:
    """The command's configuration as the planning core's :class:`RunConfig`."""
    from ..core.run_config import RunConfig
    from ..engines.registry import engine_of_options

    return RunConfig(
        micro_batch_size=args.micro_batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        activation_checkpointing=checkpointing_of(args),
        optim=args.optim or _default_optim(args.device), precision=args.precision, device=args.device,
        world_size=args.world_size,
        shard=args.shard, seq_len=args.seq_len, task=args.task, seq2seq_target_len=args.target_len,
        engine=engine_of_options(args),
    )


def planning_request(args: argparse.Namespace, budget: int, given: Any) -> PlanRequest:
    """The one planning request of the command: the chooser's candidates and one cache of predictions
    (the estimator, as the auto mode's predictor, seeded with the command's own estimate ``given``),
    from which the plan and the remedy table are read."""
    from ..planning.catalogue import with_state_share
    from ..planning.chooser import PlanRequest
    from ..planning.plan import Plan
    from ..planning.predict import EstimatorPredictor

    run = with_state_share(_run_config(args), given)
    extra = dict(peft_kwargs(args), **gpu_kwargs(args))
    if args.top > 0:  # every prediction lists its peak tensors: what each remedy removes
        extra["top_tensors"] = args.top
    predictor = EstimatorPredictor(args.model, run, extra=extra)
    predictor.remember(Plan.of(run), given)
    return PlanRequest(run, predictor, budget)


def remedies(request: PlanRequest, args: argparse.Namespace, given: Any) -> list[dict[str, Any]]:
    """The remedy table: each setting of the chooser's candidates (checkpointing x optimizer) at the
    given micro-batch, the estimator's peak and the chooser's prediction of it (margin included:
    what ``fits`` compares), and the largest micro-batch of that setting that fits (same effective
    batch) — all from ``request``'s predictions (:func:`~hf_memwatch.planning.remedies.setting_rows`)."""
    from ..measure.peak_tensors import removed_by
    from ..planning.remedies import setting_rows

    rows = []
    for row in setting_rows(request):
        estimated = request.predictor.estimate(row.plan)
        removes = None
        if args.top > 0 and given.peak_tensors is not None and row.changes and estimated.peak_tensors is not None:
            removes = removed_by(given.peak_tensors, estimated.peak_tensors)
        rows.append({
            "remedy": row.label, "activation_checkpointing": row.plan.activation_checkpointing, "optim": row.plan.optim,
            "peak_bytes": int(estimated.peak_bytes), "predicted_peak": row.predicted_peak, "fits": row.fits,
            "largest_fitting_batch": row.largest_fitting.micro_batch_size if row.largest_fitting else 0,
            "removes": removes,
        })
    return rows


def _plan(request: PlanRequest) -> dict[str, Any] | None:
    """The planning core's choice (the auto mode's, for the same configuration and budget)."""
    result = request.choose()
    if result.chosen is None:
        return None
    return dict(result.chosen.as_dict(), explain=result.chosen.reason)


#: Exit status when a budget was given and neither the configuration nor any remedy fits it.
NOTHING_FITS = 1


def positions_warning(model: Any, lengths: dict[str, int | None]) -> str | None:
    """A line when a requested length exceeds the model's positions (``max_position_embeddings``,
    ``n_positions``): such a sequence cannot run, the figure would be for a step that cannot exist."""
    config = readable_config(model)
    if config is None:
        return None
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        positions = getattr(config, name, None)
        if isinstance(positions, int) and positions > 0:
            over = [f"{flag} {value}" for flag, value in lengths.items() if value is not None and value > positions]
            if over:
                return (f"warning: {', '.join(over)} exceeds the model's {positions} positions ({name}); "
                        "the model cannot run such a sequence, the estimate is for a step that cannot exist")
            return None
    return None


def gpu_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``gpu=`` of :func:`estimate` from ``--gpu`` (empty without it); one-line errors: an unknown card, or
    ``--gpu`` for a CPU target."""
    if getattr(args, "gpu", None) is None:
        return {}
    if args.device != "cuda":
        raise MemWatchConfigError(f"--gpu {args.gpu} is for a CUDA target: add --device cuda")
    return {"gpu": gpu_spec(args.gpu)}


def _default_optim(device: str) -> str:
    """The optimizer a run without ``--optim`` gets on ``device`` (the Trainer's default on CUDA)."""
    from ..estimation.cuda_optim import default_optim

    return default_optim(device)


def with_deprecated_keys(payload: dict[str, Any]) -> dict[str, Any]:
    """The ``--json`` object with ``config``'s old keys (``batch_size``, ``accum``, ``checkpointing``) written
    beside the new ones for one release, and ``deprecated_keys`` naming them (``config.batch_size``, ...)."""
    config = payload.get("config")
    if not isinstance(config, dict):
        return payload
    config, old = RenamedKeys(config).with_old_keys()
    return {**payload, "config": config, "deprecated_keys": [f"config.{name}" for name in old]}


def run(args: argparse.Namespace) -> int:
    """Estimate, print (table or JSON); 0 on success, :data:`NOTHING_FITS` when nothing fits the
    budget. Errors raise and the dispatcher exits 2."""
    from ..estimation.estimate import estimate, logits_bytes
    from ..planning.catalogue import advice

    budget = None if args.budget is None else parse_bytes(args.budget)
    card = gpu_kwargs(args)
    # libraries print on import (transformers' W&B offline notice): stdout is for our output only,
    # stderr for one line on error
    with contextlib.redirect_stdout(io.StringIO()):
        args.model = subject_of(args)  # MODEL, or its config with --weights-dtype set
        result = estimate(args.model, budget=budget, **_run_config(args).estimate_kwargs(), **peft_kwargs(args),
                          **eval_kwargs(args), top_tensors=max(args.top, 0), **card)
        payload = result.to_dict()
        payload["weights"] = weights_dtype(args, args.model)
        if args.activation_checkpointing is None and checkpointing_of(args):
            payload["notes"] = [*payload.get("notes", []), "activation checkpointing on, as "
                                "prepare_model_for_kbit_training turns it on for a quantized base (--no-activation-checkpointing: off)"]
        # Savings that change what is computed (a fused loss, no reference model): shown, never planned.
        payload["advice"] = [item.as_dict() for item in advice(
            _run_config(args), result.frozen_models, logits_bytes(result), result.peak_bytes, classes=result.classes,
            peak_phase=result.peak_phase)]
        if budget is not None:
            request = planning_request(args, budget, result)
            payload["plan"] = _plan(request)  # the choice first: the table reads the predictions it made
            payload["remedies"] = remedies(request, args, result)
            payload["largest_fitting_batch"] = payload["remedies"][0]["largest_fitting_batch"]
            payload["fits"] = payload["remedies"][0]["fits"]  # the plan's verdict: the peak + the planning margin
    warning = positions_warning(args.model, {"--seq-len": args.seq_len, "--eval-seq-len": args.eval_seq_len})
    if warning:  # after the estimate: an error of the request itself stays the one line
        print(warning, file=sys.stderr)
        payload["warnings"] = [warning]
    if args.json:
        print(json.dumps(with_deprecated_keys(payload)))
    else:
        _print_table(payload)
    if budget is not None and not payload["fits"] and payload.get("plan") is None:
        smallest = min((row["peak_bytes"] for row in payload["remedies"]), default=payload["peak_bytes"])
        print(f"hf-memwatch estimate: nothing fits the budget {format_bytes(budget)}: the smallest remedy "
              f"needs {format_bytes(smallest)} at micro-batch {args.micro_batch_size}", file=sys.stderr)
        print(what_to_try(request, budget), file=sys.stderr)
        return NOTHING_FITS
    return 0


def what_to_try(request: PlanRequest, budget: int) -> str:
    """The lines of a stop that say what to try (:mod:`hf_memwatch.planning.no_fit`), after the first."""
    from ..planning.no_fit import no_fit_report

    with contextlib.redirect_stdout(io.StringIO()):
        text, _ = no_fit_report(request.choose(), request.predictor, budget, format_bytes(budget))
    return text.split("\n", 1)[1]


def _print_table(payload: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cfg = payload["config"]
    peak = payload["peak_bytes"]
    quant = cfg.get("quantization")
    extras = (" · checkpointing" if cfg["activation_checkpointing"] else "") + (
        f" · {quant['bits']}-bit base" + (f" {quant['quant_type']}" if quant["bits"] == 4 else "") if quant else "") + (
        f" · accum {cfg['gradient_accumulation_steps']}" if cfg["gradient_accumulation_steps"] > 1 else "")
    title = (f"{cfg['model']} · {cfg['task']} · batch {cfg['micro_batch_size']} x {cfg['seq_len']} tokens · "
             f"{cfg['precision']} · {cfg['optim']}{extras}")
    table = Table(title=title)
    table.add_column("class")
    table.add_column("bytes", justify="right")
    table.add_column("", justify="right")
    table.add_column("share", justify="right")
    for name in ESTIMATE_CLASSES:
        value = payload["classes"][name]
        table.add_row(name, f"{value:,}", format_bytes(value), f"{100 * value / peak:.1f}%" if peak else "-")
        for detail, part in payload.get("details", {}).get(name, {}).items():  # e.g. the logits, inside
            table.add_row(f"  of which {detail}", f"{part:,}", format_bytes(part),
                          f"{100 * part / peak:.1f}%" if peak else "-", style="dim")
    table.add_row("peak", f"{peak:,}", format_bytes(peak), "100%", style="bold")
    cuda = add_cuda_rows(table, payload)
    console.print(table)
    console.print(peak_line(payload))
    for line in (card_fit_line(payload), CUDA_MEANINGS if cuda else None, weights_line(payload.get("weights"))):
        if line:
            console.print(line)
    for note in payload["notes"]:
        console.print(f"note: {note}")
    if payload.get("peak_tensors"):
        from ..measure.peak_tensors import PeakTensors

        if tensors_scope(payload):
            console.print(tensors_scope(payload))
        print_peak_tensors(PeakTensors.from_record(payload["peak_tensors"]), payload["peak_phase"], console)
    print_eval(payload, console)
    for item in payload.get("advice", []):
        console.print(f"advice (not planned): {item['name']} saves up to {format_bytes(item['saving'])} — {item['how']}")
    if payload.get("budget") is None:
        return
    console.print(budget_line(payload))
    remedy_table = Table(title="remedies")
    for column in remedy_columns(payload):
        remedy_table.add_column(column)
    for row in payload["remedies"]:
        remedy_table.add_row(*remedy_cells(payload, row))
    console.print(remedy_table)
    for row in payload["remedies"]:
        if row.get("removes"):
            console.print(removes_line(payload, row))
    plan = payload.get("plan")
    console.print(f"plan (same effective batch): {plan['explain'] if plan else 'nothing fits'}")


def print_peak_tensors(peak: PeakTensors, phase: str, console: Any, groups: int = 5) -> None:
    """The largest tensors at the peak (``--top N``), then the bytes by module and by operator."""
    from rich.table import Table

    from ..measure.peak_tensors import headline

    for line in headline(peak, phase):
        console.print(line)
    table = Table(title=f"the {len(peak.tensors)} largest tensors at the peak")
    for column in ("bytes", "shape", "dtype", "class", "operator", "module", "stage"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for t in peak.tensors:
        table.add_row(format_bytes(t.bytes), " × ".join(map(str, t.shape)), t.dtype, t.cls, t.operator,
                      t.module, t.stage)
    console.print(table)
    for title, rows in (("by module", peak.by_module), ("by operator", peak.by_operator)):
        console.print(f"{title}: " + ", ".join(f"{g.name} {format_bytes(g.bytes)} ({g.count})" for g in rows[:groups]))
