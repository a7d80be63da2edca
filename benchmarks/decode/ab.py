"""Decode step time of this checkout against another one (before/after a change), in one run.

    git archive <old-commit> | tar -x -C /tmp/base
    python benchmarks/decode ab --baseline /tmp/base [--model smollm2] [--streams 1 8]
        [--rounds 3] [--steps 32] [--threads 1] [--keep-gguf | --scheme int4]

Workload: N streams (``--streams``) with distinct 32-token prompts, greedy, EOS ignored, admitted
at once; after every stream decodes, ``--steps`` decode-only steps are timed (float32, the GGUF
dequantized; with ``--keep-gguf`` its quantized types kept as each checkout keeps them; with
``--scheme`` one of ``decode.common.SCHEMES``, as ``offline`` and ``profile`` load it). Each
round runs one worker process per checkout, the two in turn (each checkout's ``prefixserve`` put
first on ``PYTHONPATH``), so a busy minute hits both. Measured per step:
wall time and the engine thread's CPU time (``time.thread_time``). With ``--threads 1`` the CPU
time is the work the step did, whatever else the machine runs: the figure to trust on a shared
machine, where wall times swing with the load. Printed: min and median of each over all rounds,
and the new/baseline ratio of the medians. Machine: this one, CPU. Baseline: ``--baseline``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from decode.common import SCHEMES, set_threads, start_streams, write

HERE = Path(__file__).resolve()
THIS_CHECKOUT = HERE.parents[2]


def measure(
    model: str, streams: list[int], steps: int, threads: int, keep: bool, scheme: str | None
) -> dict:
    """In a worker: {streams: {"wall": [s per step], "cpu": [...]}} for this process's engine."""
    from prefixserve import LLM

    set_threads(threads)
    load = SCHEMES[scheme] if scheme else {"gguf_dequantize": not keep}
    engine = LLM(model, num_kv_blocks=512, **load).llm_engine
    result = {}
    for n in [1, *streams]:  # the first pass warms up
        start_streams(engine, n, steps + 1)
        wall, cpu = [], []
        while engine.has_unfinished_requests():
            w, c = time.perf_counter(), time.thread_time()
            engine.step()
            wall.append(time.perf_counter() - w)
            cpu.append(time.thread_time() - c)
        result[n] = {"wall": wall, "cpu": cpu}
    return {n: result[n] for n in streams}


def run_worker(checkout: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    # each checkout first on the path, this one too: from cwd "/" an editable install would
    # otherwise resolve ``prefixserve`` to whichever checkout it was installed from
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE.parent), "ab", "--worker", "--model", args.model, "--steps",
           str(args.steps), "--threads", str(args.threads), "--streams", *map(str, args.streams),
           *(["--keep-gguf"] if args.keep_gguf else []),
           *(["--scheme", args.scheme] if args.scheme else [])]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="the other checkout's root")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--keep-gguf", action="store_true",
                        help="keep the GGUF's quantized types (default: dequantize)")  # fmt: skip
    parser.add_argument("--scheme", choices=sorted(SCHEMES), help="load as benchmarks' SCHEMES")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=str(THIS_CHECKOUT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.worker:
        result = measure(
            args.model, args.streams, args.steps, args.threads, args.keep_gguf, args.scheme
        )
        print(json.dumps(result))
        return None
    if args.baseline is None:
        parser.error("--baseline is required")
    checkouts = {"baseline": args.baseline.resolve(), "new": THIS_CHECKOUT}
    steps: dict[str, dict[str, dict[str, list[float]]]] = {k: {} for k in checkouts}
    for _ in range(args.rounds):
        for name, checkout in checkouts.items():
            for n, times in run_worker(checkout, args).items():
                for kind, values in times.items():
                    steps[name].setdefault(n, {}).setdefault(kind, []).extend(values)
    summary = {}
    for n in map(str, args.streams):
        row = {}
        for kind in ("wall", "cpu"):
            for name in checkouts:
                values = steps[name][n][kind]
                row[f"{name}_{kind}_ms"] = {
                    "min": 1e3 * min(values),
                    "median": 1e3 * statistics.median(values),
                }
            row[f"{kind}_ratio"] = (
                row[f"new_{kind}_ms"]["median"] / row[f"baseline_{kind}_ms"]["median"]
            )
        summary[n] = row
        print(f"{n:>3s} streams, ms per step (min / median):  "
              f"CPU {row['baseline_cpu_ms']['min']:.1f} / {row['baseline_cpu_ms']['median']:.1f}"
              f" -> {row['new_cpu_ms']['min']:.1f} / {row['new_cpu_ms']['median']:.1f}"
              f" (x{row['cpu_ratio']:.2f});  wall {row['baseline_wall_ms']['min']:.1f} / "
              f"{row['baseline_wall_ms']['median']:.1f} -> {row['new_wall_ms']['min']:.1f} / "
              f"{row['new_wall_ms']['median']:.1f} (x{row['wall_ratio']:.2f})")  # fmt: skip
    result = {"model": args.model, "threads": args.threads, "baseline": str(args.baseline),
              "keep_gguf": args.keep_gguf, "scheme": args.scheme, "summary": summary,
              "steps": steps}  # fmt: skip
    write(args.out_dir, "decode_ab.json", result)
    return result
