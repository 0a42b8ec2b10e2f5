"""One estimate, one set of figures: what ``hf-memwatch estimate`` prints beside its table, each figure
named with what it is and derived from the one estimate and the one planning request.

- the peak's phase as the user reads it (:func:`~hf_memwatch.core.categories.phase_words`:
  ``after_backward`` is the backward's peak);
- the weights' dtype the estimate assumed and where it came from (the config's ``torch_dtype``, as
  ``from_pretrained`` loads it; ``--weights-dtype`` overrides it);
- on a CUDA target, the caching allocator's reserve and the device total beside the allocated peak,
  each with its meaning;
- the remedies: each one's peak, what it saves against the table's peak, and the figure the plan
  compares with the budget (the peak plus the planning margin, ``ESTIMATE_MARGIN``), so the plan line,
  the table, ``--top`` and ``--json`` read the same numbers.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..core.categories import phase_words
from ..core.choices import PRECISIONS
from ..core.errors import MemWatchConfigError
from ..core.units import format_bytes

#: torch dtype name -> the names the CLI uses (PRECISIONS' spelling)
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

CUDA_MEANINGS = (
    "peak: bytes in tensors at the step's peak (torch.cuda.max_memory_allocated); "
    "reserved: what PyTorch's caching allocator holds from the card then (max_memory_reserved: the figure "
    "an out-of-memory is decided on); device total: reserved + the CUDA context + NCCL buffers (what "
    "nvidia-smi shows; measured only where a CUDA device is at hand)"
)


def add_figure_arguments(parser: argparse.ArgumentParser) -> None:
    """``--weights-dtype``: the dtype the model's weights are loaded in (default: the config's)."""
    parser.add_argument("--weights-dtype", choices=PRECISIONS, default=None,
                        help="the dtype the weights are loaded in (default: the config's torch_dtype, as "
                             "from_pretrained loads them; fp32 when the config names none)")


def subject_of(args: argparse.Namespace) -> Any:
    """What is estimated: MODEL as given, or its config with ``dtype`` set to ``--weights-dtype``."""
    if args.weights_dtype is None:
        return args.model
    if args.model is None:
        raise MemWatchConfigError("--weights-dtype needs MODEL (the base's config)")
    import torch

    from ..estimation.estimate import load_config

    config = load_config(args.model)
    config.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.weights_dtype]
    return config


def weights_dtype(args: argparse.Namespace, subject: Any) -> dict[str, str] | None:
    """``{"dtype": "bf16", "source": ...}``: the weights' dtype the estimate assumed and why (None when
    the config cannot be read here: the estimate reports that)."""
    if args.weights_dtype is not None:
        return {"dtype": args.weights_dtype, "source": "--weights-dtype"}
    config = readable_config(subject)
    if config is None:
        return None
    # transformers 5: ``dtype``; older: ``torch_dtype`` (reading it in 5 warns that it is deprecated)
    dtype = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    if name is None or name == "float32":
        return {"dtype": "fp32", "source": "the config names no torch_dtype" if name is None else
                "the config's torch_dtype"}
    return {"dtype": _DTYPE_NAMES.get(name, name),
            "source": "the config's torch_dtype, as from_pretrained loads the weights by default"}


def readable_config(model: Any) -> Any:
    """MODEL's config, or None where there is none or it cannot be read (the estimate reports why)."""
    if model is None:
        return None
    from ..estimation.estimate import load_config

    try:
        return load_config(model)
    except Exception:  # noqa: BLE001 - the estimate itself reports an unreadable model
        return None


def weights_line(info: dict[str, str] | None) -> str | None:
    """``weights bf16 (the config's torch_dtype, ...); --weights-dtype fp32 to estimate fp32 weights``."""
    if info is None:
        return None
    other = "fp32" if info["dtype"] != "fp32" else "bf16"
    return f"weights {info['dtype']} ({info['source']}); --weights-dtype {other} to estimate {other} weights"


def peak_line(payload: dict[str, Any]) -> str:
    """The line under the table: when the peak is, the parameters, the target."""
    cfg = payload["config"]
    return (f"peak {phase_words(payload['peak_phase'])} · params {payload['params']:,} "
            f"(trainable {payload['trainable_params']:,}) · target {cfg['device']}{card_text(cfg)}")


def card_text(cfg: dict[str, Any]) -> str:
    """`` · GPU H100-80GB (sm_90, 79.2 GiB)`` for a CUDA target's card (empty for a CPU target)."""
    card = cfg.get("gpu")
    if not card:
        return ""
    major, minor = card["capability"]
    return f" · GPU {card['name']} (sm_{major}{minor}, {format_bytes(card['memory'])})"


def card_fit_line(payload: dict[str, Any]) -> str | None:
    """Without a budget, a CUDA target's verdict against the card's memory (``fits``: ``gpus.card_fits``)."""
    card = payload["config"].get("gpu")
    if payload.get("budget") is not None or not card or payload.get("fits") is None:
        return None
    held = payload.get("device_bytes") or payload.get("reserved_bytes")
    verdict = "[green]fits[/green]" if payload["fits"] else "[red]does not fit[/red]"
    what = "device total" if payload.get("device_bytes") else "reserved"
    return f"{card['name']} ({format_bytes(card['memory'])}): {verdict} ({what} {format_bytes(held)})"


def add_cuda_rows(table: Any, payload: dict[str, Any]) -> bool:
    """On a CUDA target: the reserve and the device total under the peak row; True when added."""
    reserved = payload.get("reserved_bytes")
    if payload["config"].get("device") != "cuda" or reserved is None:
        return False
    peak = payload["peak_bytes"]
    table.add_row("reserved (caching allocator)", f"{reserved:,}", format_bytes(reserved),
                  f"{100 * reserved / peak:.1f}%" if peak else "-")
    device = payload.get("device_bytes")
    table.add_row("device total", "-" if device is None else f"{device:,}",
                  "unknown (no GPU here)" if device is None else format_bytes(device),
                  f"{100 * device / peak:.1f}%" if device is not None and peak else "-")
    return True


def tensors_scope(payload: dict[str, Any]) -> str | None:
    """When ``--top``'s tensors come from a shallower simulation than the table's peak, the line that
    says so with both figures (the table's peak is extrapolated to every layer)."""
    record = payload.get("peak_tensors")
    if not record or record.get("peak") == payload["peak_bytes"]:
        return None
    return (f"the tensors below are those of the simulation of fewer layers (its peak {format_bytes(record['peak'])}); "
            f"the table's peak {format_bytes(payload['peak_bytes'])} is extrapolated to every layer")


def remedy_columns(payload: dict[str, Any]) -> list[str]:
    """The remedy table's columns: the planned figure is the peak plus the planning margin."""
    from ..planning.predict import ESTIMATE_MARGIN

    return ["remedy", "peak", "saves", f"planned (+{100 * ESTIMATE_MARGIN:g}%)", "fits", "largest micro-batch"]


def remedy_cells(payload: dict[str, Any], row: dict[str, Any]) -> list[str]:
    """One row of the remedy table, its saving against the table's peak."""
    saves = payload["peak_bytes"] - row["peak_bytes"]
    return [row["remedy"], format_bytes(row["peak_bytes"]), "-" if row["remedy"] == "as given" else format_bytes(saves),
            format_bytes(row["predicted_peak"]), "yes" if row["fits"] else "no", str(row["largest_fitting_batch"])]


def removes_line(payload: dict[str, Any], row: dict[str, Any]) -> str:
    """What a remedy takes off the peak: its saving (the table's figures), then the tensors ``--top`` saw go."""
    scope = " (of the shallower simulation)" if tensors_scope(payload) else ""
    return (f"{row['remedy']}: saves {format_bytes(payload['peak_bytes'] - row['peak_bytes'])} "
            f"({format_bytes(payload['peak_bytes'])} -> {format_bytes(row['peak_bytes'])}); at the peak{scope} it "
            "removes: " + "; ".join(row["removes"]))


def budget_line(payload: dict[str, Any]) -> str:
    """Whether the configuration as given fits, by the figure the plan compares (peak + margin)."""
    given = payload["remedies"][0]
    verdict = "[green]fits[/green]" if given["fits"] else "[red]does not fit[/red]"
    return (f"budget {format_bytes(payload['budget'])}: {verdict} (planned {format_bytes(given['predicted_peak'])}: "
            f"the peak {format_bytes(payload['peak_bytes'])} + the planning margin); largest micro-batch that fits "
            f"(same effective batch): {payload['largest_fitting_batch']}")
