"""Where one decode step's time goes: schedule, prepare, forward, sample, output (bench model).

    python benchmarks/step_profile.py [--quick] [--batch-sizes 64] [--steps 32] [--prompt-len 16]

Workload: B requests with distinct random prompts of ``--prompt-len`` tokens, greedy, EOS ignored,
long enough outputs that all B stay decoding. The engine steps until every request has its first
token (all decoding), then ``LLMEngine.stats().step_times`` is read before and after a window of
``--steps`` decode-only steps (B tokens each). The step's wall time is also taken around each
``step()`` call, so time that no phase accounts for shows up as ``unaccounted``.
Machine: this CPU, float32, ``--threads`` torch threads. Baseline: the target that at most 15% of
a batch-64 step runs outside the model forward.

Prints per batch size the ms per step of each phase and the % outside the forward; writes
``step_profile.json`` / ``.png`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from bench_model import (
    DEFAULT_MODEL_DIR,
    RESULTS_DIR,
    ensure_checkpoint,
    greedy,
    machine,
    make_engine,
    set_threads,
)
from report import save_figure, write_json
from workloads import random_tokens

PHASES = ("schedule", "prepare", "forward", "sample", "output")
TARGET_NON_FORWARD_PCT = 15.0


def profile(folder: Path, batch: int, steps: int, prompt_len: int, seed: int) -> dict:
    """Per-phase seconds per step over ``steps`` decode-only steps of ``batch`` sequences."""
    engine = make_engine(folder, max_num_seqs=max(batch, 1))
    rng = random.Random(seed)
    for i in range(batch):
        engine.add_request(f"r{i}", random_tokens(rng, prompt_len), greedy(steps + 16))
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
    engine.step()  # one more decode step so every sequence is past its prefill bookkeeping
    before = engine.stats().step_times
    wall = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        wall += time.perf_counter() - t0
        if len(outputs) != batch or any(o.finished for o in outputs):
            raise RuntimeError("the window must hold decode steps of the whole batch")
    after = engine.stats().step_times
    per_step = {p: (getattr(after, p) - getattr(before, p)) / steps for p in PHASES}
    step_s = wall / steps
    per_step["unaccounted"] = step_s - sum(per_step.values())
    non_forward = step_s - per_step["forward"]
    return {
        "batch": batch,
        "steps": steps,
        "step_ms": 1e3 * step_s,
        "phase_ms": {k: 1e3 * v for k, v in per_step.items()},
        "phase_pct": {k: 100 * v / step_s for k, v in per_step.items()},
        "non_forward_pct": 100 * non_forward / step_s,
        "decode_tokens_per_s": batch / step_s,
    }


def plot(rows: list[dict], title: str, path: Path) -> Path:
    """Stacked bars of ms per step by phase, one bar per batch size."""
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [str(r["batch"]) for r in rows]
    bottom = [0.0] * len(rows)
    for phase in (*PHASES, "unaccounted"):
        values = [max(0.0, r["phase_ms"][phase]) for r in rows]
        ax.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(rows):
        ax.annotate(
            f"{r['non_forward_pct']:.1f}% non-forward",
            (i, bottom[i]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xlabel("decoding sequences per step")
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="batches 4 and 8, 4 steps")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.steps = [4, 8], 4
    set_threads(args.threads)
    folder = ensure_checkpoint(args.model_dir)
    info = machine()
    rows = [profile(folder, b, args.steps, args.prompt_len, args.seed) for b in args.batch_sizes]
    tag = " [QUICK]" if args.quick else ""
    result = {
        "workload": {
            "name": "step_profile",
            "description": f"decode-only steps of B sequences, prompts {args.prompt_len} tokens, "
            f"window {args.steps} steps",
        },
        "quick": args.quick,
        "machine": info,
        "baseline": f"target: <= {TARGET_NON_FORWARD_PCT:.0f}% of a batch-64 step outside forward",
        "rows": rows,
    }
    out_dir = Path(args.out_dir)
    write_json(result, out_dir / "step_profile.json")
    plot(
        rows,
        f"prefixserve decode step split, bench model, {info['torch_threads']} threads, "
        f"float32{tag}",
        out_dir / "step_profile.png",
    )
    for r in rows:
        phases = " ".join(f"{k} {v:.2f}" for k, v in r["phase_ms"].items())
        print(
            f"step_profile{tag}: batch {r['batch']}: {r['step_ms']:.1f} ms/step ({phases} ms) | "
            f"non-forward {r['non_forward_pct']:.1f}% (target <= {TARGET_NON_FORWARD_PCT:.0f}%) "
            f"| {r['decode_tokens_per_s']:.0f} decode tok/s"
        )
    return result


if __name__ == "__main__":
    main()
