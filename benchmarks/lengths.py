"""Time to find the worst batch of a 1M-row tokenized ``datasets.Dataset`` (hf_memwatch.planning.lengths).

Builds the dataset straight in Arrow (random lengths 8-255, one long sample near the end), then
times :func:`~hf_memwatch.planning.lengths.worst_batch` on it as stored and after ``shuffle``
(an index mapping over the table). Writes a Markdown table.

    python benchmarks/lengths.py --out benchmarks/results/lengths.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from hf_memwatch.planning.lengths import worst_batch


def token_dataset(rows: int, long_index: int, long_length: int, seed: int = 0):
    """A ``datasets.Dataset`` with an ``input_ids`` list column (int32 tokens) and a label column."""
    import datasets

    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 256, rows).astype(np.int64)
    lengths[long_index] = long_length
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = pa.array(np.zeros(int(offsets[-1]), dtype=np.int32))
    ids = pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), values)
    table = pa.table({"input_ids": ids, "label": pa.array(rng.integers(0, 2, rows))})
    return datasets.Dataset(table)


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    long_index, long_length = args.rows - 1234, 4096
    build_start = time.perf_counter()
    dataset = token_dataset(args.rows, long_index, long_length)
    build = time.perf_counter() - build_start
    shuffled = dataset.shuffle(seed=0)
    rows = []
    for name, ds in (("as stored", dataset), ("shuffled (index mapping)", shuffled)):
        seconds, wb = timed(lambda ds=ds: worst_batch(ds, micro_batch_size=8, max_length=None,
                                                       pad_to_multiple_of=64), args.repeats)
        assert wb.length == long_length and len(ds[wb.index]["input_ids"]) == long_length, wb
        assert ds is not dataset or wb.index == long_index, wb
        rows.append((name, seconds, wb))
        print(f"{name}: {seconds * 1000:.1f} ms, longest sample index {wb.index} length {wb.length}, "
              f"batch {wb.batch_length} x 8 ({wb.source})")

    lines = [
        "# Worst batch of the whole dataset: time to read every length",
        "",
        f"`python benchmarks/lengths.py` — {args.rows:,} rows, `input_ids` lengths uniform in 8–255 tokens plus one "
        f"sample of {long_length} at index {long_index:,}; median of {args.repeats} runs; "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"pyarrow {pa.__version__}. Building the dataset took {build:.1f} s (not counted).",
        "",
        "| dataset | time | longest sample found | padded batch (micro 8, pad to 64) | source |",
        "|---|---:|---|---|---|",
    ]
    for name, seconds, wb in rows:
        lines.append(f"| {name} | {seconds * 1000:.1f} ms | index {wb.index:,}, {wb.length} tokens | "
                     f"{wb.batch_length} × 8 = {wb.batch_tokens:,} tokens | {wb.source} |")
    lines += ["", "Requirement: ≤ 2 s for 1M rows. No Python row is built: `pyarrow.compute.list_value_length` "
              "reads the list offsets only."]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
