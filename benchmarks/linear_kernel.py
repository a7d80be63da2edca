"""Speed of the float32 linear kernel (``kernels/cpu_linear.cpp``, ``linear_f32``) per number of
input rows, against the memory roofline, optionally beside another checkout's kernel.

    python benchmarks/linear_kernel.py [--baseline <checkout>] [--rows 1 2 4 8 16 32]
        [--threads 1 2] [--rounds 5]

Workload: one pass over SmolLM2-135M's float32 matrices (30 layers of qkv 960x576, o 576x576,
gate/up 3072x576, down 576x1536, and the 49152x576 lm_head: 538 MB, far past the caches, as in a
decode step), random weights and inputs, M rows of x each call. Each round runs one worker process
per checkout and thread count, the checkouts in turn (each checkout's ``prefixserve`` first on
``PYTHONPATH``), so a busy minute hits both; each worker times ``--passes`` passes per row count
and keeps the fastest. Printed per checkout, threads and rows, the median over rounds (and the
fastest round): ms per pass, GFLOP/s (2 M per weight), weight GB/s, and the roofline share: the
time to read the weights once at the copy bandwidth (``peers.roofline``, measured once) over the
pass's time. With one thread the figures hold up on a shared machine; with two, every pass waits
for whichever thread another process preempted. Machine: this one, CPU.
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

HERE = Path(__file__).resolve()
THIS_CHECKOUT = HERE.parents[1]
LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K)
LM_HEAD = (49152, 576)


def measure(rows: list[int], passes: int) -> dict:
    """In a worker: {rows: fastest seconds per pass} for this process's kernel."""
    import torch

    from prefixserve.kernels import cpu_linear, cpu_ops

    assert cpu_ops.available()
    gen = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * LAYERS + [LM_HEAD]
    weights = [(cpu_linear.pack_f32(torch.randn(n, k, generator=gen)), n, k) for n, k in shapes]
    result = {}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        best = float("inf")
        for _ in range(passes + 1):  # the first warms up
            start = time.perf_counter()
            for w, n, k in weights:
                cpu_linear.linear_f32(xs[k], w, None, n)
            best = min(best, time.perf_counter() - start)
        result[m] = best
    return result


def run_worker(checkout: Path, threads: int, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(HERE), "--worker", "--passes", str(args.passes),
           "--rows", *map(str, args.rows)]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True, check=True)
    return {int(m): t for m, t in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", type=Path, help="the other checkout's root")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.rows, args.passes)))
        return
    sys.path.insert(0, str(HERE.parent))  # benchmarks/: peers
    from peers.roofline import copy_bandwidth

    bandwidth = copy_bandwidth()
    params = sum(n * k for n, k in LAYER_SHAPES) * LAYERS + LM_HEAD[0] * LM_HEAD[1]
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; {4 * params / 1e6:.0f} MB of weights a pass")
    checkouts = {"new": THIS_CHECKOUT} | ({"base": args.baseline} if args.baseline else {})
    times: dict = {(c, t): {m: [] for m in args.rows} for c in checkouts for t in args.threads}
    for _ in range(args.rounds):
        for threads in args.threads:
            for name, checkout in checkouts.items():
                for m, t in run_worker(checkout, threads, args).items():
                    times[name, threads][m].append(t)
    print("checkout threads rows  ms/pass (min)  GFLOP/s  GB/s  roofline")
    for (name, threads), per_rows in times.items():
        for m, ts in per_rows.items():
            t = statistics.median(ts)
            share = 4 * params / bandwidth / t
            print(f"{name:8} {threads:7} {m:4} {1e3 * t:7.1f} ({1e3 * min(ts):5.1f}) "
                  f"{2 * m * params / t / 1e9:7.1f} {4 * params / t / 1e9:5.1f} "
                  f"{100 * share:8.0f}%")  # fmt: skip


if __name__ == "__main__":
    main()
