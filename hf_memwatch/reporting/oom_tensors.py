"""The OOM post-mortem's "Largest tensors" section: what was alive when the allocation failed.

On the CPU, inside a fully tracked step, every storage alive at the failure (the census of
:mod:`hf_memwatch.measure.peak_watch`) with its module path and operator; in a light step, the peak of
the last fully tracked step (its ``peak_tensors`` record). On CUDA, the caching allocator's snapshot
(block sizes; the allocating frame when ``record_history=True``).
"""

from __future__ import annotations

from typing import Any

from ..core.units import format_bytes
from ..measure.peak_tensors import PeakTensors
from ..measure.peak_watch import cuda_allocator_tensors


def tensors_at_failure(monitor: Any) -> tuple[str, PeakTensors] | None:
    """(where the list comes from, the tensors), or None when nothing is known."""
    peaks = getattr(monitor, "peaks", None)
    if peaks is None:
        return None
    if getattr(monitor.backend, "kind", None) == "cuda":
        found = cuda_allocator_tensors(monitor.device, peaks.top or 20)
        return None if found is None else ("the CUDA allocator's blocks at the failure", found)
    classes = getattr(monitor, "_last_classes", None)
    if peaks.census is not None and monitor.backend.tracking and monitor.in_step and classes is not None:
        found = peaks.at_failure(classes)
        if found is not None:
            return (f"every storage alive when the allocation failed (step {monitor.step}, CPU tracker)", found)
    if peaks.last is not None:
        last = peaks.last
        return (f"the peak of the last fully tracked step ({last.step}, `{last.phase}`)",
                PeakTensors.from_record(last))
    return None


def tensor_lines(found: tuple[str, PeakTensors] | None, limit: int = 10) -> list[str]:
    """Markdown: the largest tensors, then the bytes by module and by operator."""
    if found is None:
        return []
    source, peak = found
    lines = ["", "## Largest tensors", "", f"From {source}: {format_bytes(peak.peak)} in {peak.count} storages.", "",
             "| bytes | shape | dtype | class | operator | module | stage |", "|---|---|---|---|---|---|---|"]
    for t in peak.tensors[:limit]:
        lines.append(f"| {format_bytes(t.bytes)} | {' × '.join(map(str, t.shape)) or '-'} | {t.dtype} | {t.cls} | "
                     f"{t.operator} | {t.module} | {t.stage} |")
    for title, groups in (("By module", peak.by_module), ("By operator", peak.by_operator)):
        lines += ["", f"{title}: " + ", ".join(f"{g.name} {format_bytes(g.bytes)} ({g.count})" for g in groups[:5])]
    return lines
