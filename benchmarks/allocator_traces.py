"""The caching-allocator replay against real allocator traces (``torch.cuda.memory._dump_snapshot`` pickles).

A snapshot taken with ``torch.cuda.memory._record_memory_history()`` on holds the allocator's own
record of every ``alloc``/``free_completed`` and every ``segment_alloc``/``segment_free`` (with
``expandable_segments``: ``segment_map``/``segment_unmap``). This script replays the trace's allocs
and frees through :class:`~hf_memwatch.estimation.cuda_allocator.CachingAllocator`, with the settings
the snapshot records (``allocator_settings``), and compares the segments the model reserves with the
ones torch reserved: their count, bytes, the multiset of their sizes, and the peak reserve (the running
sum of torch's segment events against the model's). A trace whose snapshot holds segments it never
saw allocated began after memory was already reserved: the model starts empty, so such a trace is
flagged, not compared as equal.

The pickles are read with an unpickler that refuses every class (a snapshot is dicts, lists, strings
and numbers): nothing in a file runs. No trace is committed here (they are others' data); the result
names each file's repository, path and blob.

Usage: ``python benchmarks/allocator_traces.py TRACE.pickle [...] [--label TEXT ...] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import publish  # noqa: E402

from hf_memwatch.estimation.cuda_allocator import CachingAllocator, MiB  # noqa: E402
from hf_memwatch.estimation.cuda_settings import ROUNDUP_INTERVALS, AllocatorConfig  # noqa: E402

GROWS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # noqa: ANN201 - refuses every class
        raise pickle.UnpicklingError(f"refused {module}.{name}: a snapshot holds data only")


def settings_of(snapshot: dict) -> AllocatorConfig:
    """The allocator settings the snapshot records (torch >= 2.2 writes ``allocator_settings``)."""
    found = snapshot.get("allocator_settings") or {}
    if found.get("PYTORCH_CUDA_ALLOC_CONF"):
        return AllocatorConfig.parse(found["PYTORCH_CUDA_ALLOC_CONF"])
    split = found.get("max_split_size", -1)
    divisions = found.get("roundup_power2_divisions") or {}
    values = [int(v) for _, v in sorted(divisions.items(), key=lambda kv: int(kv[0]))][:ROUNDUP_INTERVALS]
    return AllocatorConfig(max_split_size=split if 0 < split < 1 << 62 else None,
                           expandable_segments=bool(found.get("expandable_segments")),
                           roundup_power2_divisions=tuple(values) if len(values) == ROUNDUP_INTERVALS
                           else AllocatorConfig().roundup_power2_divisions,
                           garbage_collection_threshold=float(found.get("garbage_collection_threshold") or 0.0))


def compare(path: Path) -> dict:
    snapshot = _DataOnly(path.open("rb")).load()
    config = settings_of(snapshot)
    trace = snapshot["device_traces"][0]
    allocator, known, model_segments = CachingAllocator(config), set(), []
    real_reserved = real_peak = 0
    for event in trace:
        action = event["action"]
        if action in GROWS:
            real_reserved += GROWS[action] * event["size"]
            real_peak = max(real_peak, real_reserved)
        elif action == "alloc":
            before = allocator.reserved
            allocator.malloc(event["addr"], event["size"])
            known.add(event["addr"])
            if allocator.reserved > before:
                model_segments.append(allocator.reserved - before)
        elif action == "free_completed" and event["addr"] in known:
            allocator.free(event["addr"])
            known.discard(event["addr"])
    real_segments = [e["size"] for e in trace if e["action"] in ("segment_alloc", "segment_map")]
    seen = {e["addr"] for e in trace if e["action"] in ("segment_alloc", "segment_map")}
    earlier = sum(1 for s in snapshot["segments"] if s["address"] not in seen and not s.get("is_expandable"))
    return {"file": path.name, "expandable": config.expandable_segments, "events": len(trace), "earlier": earlier,
            "real": real_segments, "model": model_segments, "real_peak": real_peak,
            "model_peak": allocator.peak_reserved}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--label", action="append", default=[], help="where each trace comes from, in order")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    lines = ["# The caching-allocator replay against real allocator traces", "",
             "`python benchmarks/allocator_traces.py TRACE.pickle ... --label SOURCE ...`: each trace's allocs and "
             "frees replayed by `CachingAllocator` with the snapshot's allocator settings; the segments it reserves "
             "against torch's `segment_alloc`/`segment_map` events. A trace with segments before it began starts "
             "from memory the model does not hold: its comparison is not a test of the rules.", "",
             "| trace | source | settings | events | segments before the trace | torch: segments, MiB | "
             "model: segments, MiB | same sizes | peak reserve torch → model |", "|---" * 9 + "|"]
    for index, path in enumerate(args.traces):
        r = compare(path)
        label = args.label[index] if index < len(args.label) else ""
        same = Counter(r["real"]) == Counter(r["model"])
        change = (r["model_peak"] - r["real_peak"]) / r["real_peak"] if r["real_peak"] else 0.0
        lines.append(f"| {r['file']} | {label} | {'expandable' if r['expandable'] else 'default'} | {r['events']:,} | "
                     f"{r['earlier']} | {len(r['real'])}, {sum(r['real']) / MiB:,.0f} | "
                     f"{len(r['model'])}, {sum(r['model']) / MiB:,.0f} | {'yes' if same else 'no'} | "
                     f"{r['real_peak'] / MiB:,.0f} → {r['model_peak'] / MiB:,.0f} MiB ({change:+.1%}) |")
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
