"""How fast ``hf-memwatch estimate CONFIG`` starts: cold (a fresh process) and warm (a second call).

A Qwen3-4B-shaped ``config.json`` (36 layers, hidden 2560, vocabulary 151936; no weights, no hub) is
written to a temporary folder twice, as Qwen3-4B's own says (``torch_dtype: bfloat16``: the model
built in bf16, its matrix products bf16 CPU GEMMs) and without a dtype (fp32), and estimated at
micro-batch 1 x 512 tokens as ``hf-memwatch estimate CONFIG`` does. Wall-clock seconds, each the
median of ``--rounds`` fresh processes:

* ``cli``: the CLI end to end in a fresh subprocess (interpreter start, imports, the estimate, output),
  on each config;
* ``first estimate()``: in a fresh process, ``import hf_memwatch`` then the first ``estimate()`` (bf16
  config);
* ``warm estimate()``: the second ``estimate()`` of the same config in that process;

and the CPU seconds (user + system) of each, less sensitive than wall time to a machine shared with
other work (the load average is printed at the start and the end). ``import torch`` alone in a fresh
process, measured in the same rounds, is the floor under every cold figure; so is
``import transformers.modeling_utils`` after it (every model class needs it), measured in the same
process. Also printed: the heavy optional modules loaded by the first estimate, and the bf16 GEMM
workspace probes it ran (``kernel_workspaces``: a real product under the profiler each).

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
HEAVY = ("peft", "bitsandbytes", "transformers.trainer", "torch.distributed.tensor", "torch._dynamo", "scipy")

IN_PROCESS = r"""
import json, resource, sys, time, warnings
warnings.simplefilter("ignore")
def clock():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime
start = clock()
from hf_memwatch import estimate
est = estimate(sys.argv[1], micro_batch_size=1, seq_len=512)
first = clock()
estimate(sys.argv[1], micro_batch_size=1, seq_len=512)
warm = clock()
from hf_memwatch.estimation import kernel_workspaces
heavy = [name for name in json.loads(sys.argv[2]) if name in sys.modules]
print(json.dumps({"first": first[0] - start[0], "first_cpu": first[1] - start[1], "warm": warm[0] - first[0],
                  "warm_cpu": warm[1] - first[1], "peak": est.peak_bytes, "heavy": heavy,
                  "probes": len(kernel_workspaces._GEMM_WORKSPACES)}))
"""
FLOORS = r"""
import json, resource, time
def clock():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), usage.ru_utime + usage.ru_stime
start = clock()
import torch
middle = clock()
import transformers.modeling_utils
end = clock()
print(json.dumps({"modeling_utils": end[0] - middle[0], "modeling_utils_cpu": end[1] - middle[1]}))
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


def _round(configs: dict[str, str], samples: dict[str, list[float]]) -> dict:
    """One round of fresh processes; appends (wall, CPU) samples by row name, returns the in-process result."""
    def add(name: str, wall: float, cpu: float | None) -> None:
        samples.setdefault(name, []).append(wall)
        if cpu is not None:
            samples.setdefault(name + " cpu", []).append(cpu)

    wall, used, out = _wall([sys.executable, "-c", "import torch"])
    add("torch", wall, used)
    _, _, out = _wall([sys.executable, "-c", FLOORS])
    floors = json.loads(out.strip().splitlines()[-1])
    add("modeling_utils", floors["modeling_utils"], floors["modeling_utils_cpu"])
    for kind, config in configs.items():
        wall, used, _ = _wall([sys.executable, "-m", "hf_memwatch.cli.main", "estimate", config,
                               "--micro-batch-size", "1", "--seq-len", "512"])
        add(f"cli {kind}", wall, used)
    _, used, out = _wall([sys.executable, "-c", IN_PROCESS, configs["bf16"], json.dumps(HEAVY)])
    result = json.loads(out.strip().splitlines()[-1])
    add("first", result["first"], result["first_cpu"])
    add("warm", result["warm"], result["warm_cpu"])
    samples.setdefault("process cpu", []).append(used)
    return result


ROWS = [("import torch (fresh process, a floor)", "torch"),
        ("import transformers.modeling_utils after torch (a floor: every model class needs it)", "modeling_utils"),
        ("cli: hf-memwatch estimate CONFIG (cold), bf16 config.json (as Qwen3-4B's)", "cli bf16"),
        ("cli: hf-memwatch estimate CONFIG (cold), config.json without a dtype (fp32)", "cli fp32"),
        ("first estimate() in a fresh process (cold, imports included), bf16 config", "first"),
        ("second estimate() in that process (warm)", "warm"),
        ("that whole process (interpreter, imports, two estimates)", "process")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = parser.parse_args()
    load_start = os.getloadavg()[0]
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = {}
        for kind, extra in (("bf16", {"torch_dtype": "bfloat16"}), ("fp32", {})):
            configs[kind] = os.path.join(tmp, kind, "config.json")
            os.makedirs(os.path.dirname(configs[kind]))
            with open(configs[kind], "w", encoding="utf-8") as handle:
                json.dump({**QWEN3_4B, **extra}, handle)
        for _ in range(args.rounds):
            result = _round(configs, samples)
    lines = [
        "# Start fast: `hf-memwatch estimate CONFIG`",
        "",
        f"Qwen3-4B-shaped config.json, micro-batch 1 x 512 tokens; median of {args.rounds} fresh processes "
        f"(`python benchmarks/start_fast.py --rounds {args.rounds}`), {os.cpu_count()} CPUs shared with other "
        f"work, load average {load_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| what | wall s (median) | min | max | CPU s (median) |",
        "|---|---:|---:|---:|---:|",
    ]

    def cell(values: list[float] | None) -> str:
        return "" if not values else f"{statistics.median(values):.2f}"

    for name, key in ROWS:
        walls, cpus = samples.get(key), samples.get(key + " cpu")
        span = ("| | " if not walls else f"| {min(walls):.2f} | {max(walls):.2f} ")
        lines.append(f"| {name} | {cell(walls)} {span}| {cell(cpus)} |")
    lines += ["", "Heavy optional modules loaded by the first estimate: " + (", ".join(result["heavy"]) or "none")
              + f". bf16 GEMM workspace probes it ran: {result['probes']}."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
