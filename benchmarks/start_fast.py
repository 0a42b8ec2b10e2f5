"""How fast ``hf-memwatch estimate CONFIG`` starts: cold (a fresh process) and warm (a second call).

A Qwen3-4B-shaped ``config.json`` (36 layers, hidden 2560, vocabulary 151936; no weights, no hub) is
written to a temporary folder and estimated at micro-batch 1 x 512 tokens, fp32, as
``hf-memwatch estimate CONFIG`` does. Three figures, wall-clock seconds, each the median of
``--rounds`` fresh processes:

* ``cli``: the CLI end to end in a fresh subprocess (interpreter start, imports, the estimate, output);
* ``first estimate()``: in a fresh process, ``import hf_memwatch`` then the first ``estimate()``;
* ``warm estimate()``: the second ``estimate()`` of the same config in that process;

and the CPU seconds (user + system) of each fresh process, less sensitive than wall time to a machine
shared with other work (the load average is printed).

Also printed: the import of ``torch`` alone in a fresh process, a floor under every cold figure, and
the heavy optional modules loaded by the first estimate (peft, bitsandbytes, transformers.trainer,
torch.distributed.tensor, torch._dynamo), to show which paths the request pulled in.

Usage: ``python benchmarks/start_fast.py [--rounds 3] [--out benchmarks/results/start_fast.md]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
}
HEAVY = ("peft", "bitsandbytes", "transformers.trainer", "torch.distributed.tensor", "torch._dynamo")

IN_PROCESS = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
start = time.perf_counter()
from hf_memwatch import estimate
est = estimate(sys.argv[1], batch_size=1, seq_len=512)
first = time.perf_counter() - start
start = time.perf_counter()
estimate(sys.argv[1], batch_size=1, seq_len=512)
warm = time.perf_counter() - start
heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
print(json.dumps({"first": first, "warm": warm, "peak": est.peak_bytes, "heavy": heavy}))
"""


def _wall(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child: user + system, stdout) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=dict(os.environ))
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = os.path.join(tmp, "config.json")
        with open(config, "w", encoding="utf-8") as handle:
            json.dump(QWEN3_4B, handle)
        torch_only, cli, first, warm = [], [], [], []
        cpu: dict[str, list[float]] = {"torch": [], "cli": [], "process": []}
        heavy: list[str] = []
        for _ in range(args.rounds):
            wall, used, _ = _wall([sys.executable, "-c", "import torch"])
            torch_only.append(wall)
            cpu["torch"].append(used)
            wall, used, _ = _wall([sys.executable, "-m", "hf_memwatch.cli.main", "estimate", config,
                                   "--batch-size", "1", "--seq-len", "512"])
            cli.append(wall)
            cpu["cli"].append(used)
            _, used, out = _wall([sys.executable, "-c", IN_PROCESS, config, json.dumps(HEAVY)])
            cpu["process"].append(used)
            result = json.loads(out.strip().splitlines()[-1])
            first.append(result["first"])
            warm.append(result["warm"])
            heavy = result["heavy"]
    rows = [("import torch (fresh process, a floor)", torch_only, cpu["torch"]),
            ("cli: hf-memwatch estimate CONFIG (cold)", cli, cpu["cli"]),
            ("first estimate() in a fresh process (cold, imports included)", first, None),
            ("second estimate() in that process (warm)", warm, None),
            ("that whole process (two estimates)", None, cpu["process"])]
    lines = [
        "# Start fast: `hf-memwatch estimate CONFIG`",
        "",
        f"Qwen3-4B-shaped config.json, micro-batch 1 x 512 tokens, fp32; median of {args.rounds} fresh processes "
        f"(`python benchmarks/start_fast.py --rounds {args.rounds}`), {os.cpu_count()} CPUs, load average "
        f"{os.getloadavg()[0]:.1f} when it ended.",
        "",
        "| what | wall s (median) | min | max | CPU s of the process (median) |",
        "|---|---:|---:|---:|---:|",
    ]

    def cell(values: list[float] | None) -> str:
        return "" if values is None else f"{statistics.median(values):.2f}"

    for name, walls, cpus in rows:
        span = ("| | " if walls is None else f"| {min(walls):.2f} | {max(walls):.2f} ")
        lines.append(f"| {name} | {cell(walls)} {span}| {cell(cpus)} |")
    lines += ["", "Heavy optional modules loaded by the first estimate: " + (", ".join(heavy) or "none") + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
