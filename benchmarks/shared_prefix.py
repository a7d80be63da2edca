"""Generated shared prefix: prefixserve against transformers, side by side, on the bench model.

    python benchmarks/shared_prefix.py [--quick] [--groups 4] [--prompts-per-group 16]
        [--system-len 1024] [--question-len 32] [--output-len 32] [--hf-batch-size 16]
        [--repeats 3]

Workload (the shape of SGLang's generated-shared-prefix set, written anew): G groups, each one
system prompt of S random tokens followed by P questions of Q random tokens (seeded); every request
generates O tokens, greedy, EOS ignored; all G*P requests are submitted at once.
Machine: this CPU, float32, ``--threads`` torch threads for every system, one process.
Systems (same weights, see ``hf_baselines.py``): prefixserve (LLMEngine driven step by step),
``hf-no-reuse`` (transformers generate, static batches, left padding), ``hf-prefix-cache``
(transformers generate continuing from each group's prefilled, deep-copied DynamicCache). They run
in ``--repeats`` rounds, each system once per round and every run cold (no cache carried over);
each system's figures come from its median-time run, and every round's ratios are kept.

Reports requests/s, output tokens/s, TTFT p50/p99 and TPOT p50 per system, the throughput ratios
of prefixserve to each baseline, prefixserve's prefix-cache hits against the workload's optimum,
the greedy agreement of each baseline with prefixserve, and the TTFT of a request whose S-token
prefix is cached against the same request shape uncached. Writes ``shared_prefix.json`` and
``shared_prefix.png`` under ``--out-dir``.

``run_comparison`` is shared with ``multi_turn_agents.py`` and ``rag.py``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path

from bench_model import (
    DEFAULT_MODEL_DIR,
    RESULTS_DIR,
    BenchRequest,
    FollowUp,
    ensure_checkpoint,
    load_hf_model,
    machine,
    make_engine,
    run_engine,
    set_threads,
)
from hf_baselines import HFServer, pad_token_id
from report import agreement, hit_rate, plot_result, summarize, write_json
from workloads import parse_sizes, random_tokens


def parse_comparison_args(
    description: str, argv: list[str] | None, sizes: dict[str, tuple[int, int]]
) -> argparse.Namespace:
    """The options every side-by-side benchmark takes, and its workload ``sizes`` (``NAME: (full,
    quick)``, ``workloads.parse_sizes``), parsed from ``argv``."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--threads", type=int, default=2, help="torch threads, all systems")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="prefixserve option")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefixserve")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="rounds; each round runs every system once, in turn, and figures come from each "
        "system's median-time run (default 3, 1 with --quick)",
    )
    parser.add_argument(
        "--skip-hf", action="store_true", help="run prefixserve only (no baselines, no ratios)"
    )
    return parse_sizes(parser, argv, {"hf_batch_size": (16, 4), **sizes})


def run_comparison(
    args: argparse.Namespace,
    workload: dict,
    make_requests: Callable[[], list[BenchRequest]],
    prefix_len: dict[str, int],
    follow_up: FollowUp | None = None,
) -> dict:
    """Run the workload on prefixserve and both transformers baselines; returns the result dict.

    ``make_requests`` returns fresh requests (each system runs its own copies); ``prefix_len``
    maps a request group to the shared prefix the ``hf-prefix-cache`` baseline prefills once.
    """
    set_threads(args.threads)
    folder = ensure_checkpoint(args.model_dir)
    info = machine()
    engine = make_engine(
        folder, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
    )
    warm = [BenchRequest("warmup", random_tokens(random.Random(99), 48), 2)]
    run_engine(engine, warm)

    step_times: list[dict[str, float]] = []  # prefixserve's phases, per round

    def prefixserve() -> tuple[list[BenchRequest], float]:
        engine.reset_prefix_cache()  # every round starts cold
        before = engine.stats().step_times
        done, wall = run_engine(engine, make_requests(), follow_up)
        after = engine.stats().step_times
        step_times.append({k: v - getattr(before, k) for k, v in vars(after).items()})
        return done, wall

    systems: dict[str, Callable[[], tuple[list[BenchRequest], float]]] = {
        "prefixserve": prefixserve
    }
    if not args.skip_hf:
        model = load_hf_model(folder)
        pad = pad_token_id(model)
        HFServer(model, 1, pad).run([BenchRequest("warmup", warm[0].prompt, 2)])
        no_reuse = HFServer(model, args.hf_batch_size, pad)
        with_prefix = HFServer(model, args.hf_batch_size, pad, prefix_len)
        systems["hf-no-reuse"] = lambda: no_reuse.run(make_requests(), follow_up)
        systems["hf-prefix-cache"] = lambda: with_prefix.run(make_requests(), follow_up)
    rounds: dict[str, list[tuple[list[BenchRequest], float]]] = {name: [] for name in systems}
    repeats = args.repeats if args.repeats is not None else 1 if args.quick else 3
    for _ in range(max(1, repeats)):
        for name, run in systems.items():
            rounds[name].append(run())
    # Each system's median run by wall time (for an even count, the slower of the middle two).
    median = {
        name: sorted(range(len(rs)), key=lambda i: rs[i][1])[len(rs) // 2]
        for name, rs in rounds.items()
    }
    runs = {name: rounds[name][i] for name, i in median.items()}
    done = runs["prefixserve"][0]
    systems_summary = {name: summarize(d, w) for name, (d, w) in runs.items()}
    block_size = engine.config.block_size
    result = {
        "workload": workload,
        "quick": args.quick,
        "machine": {**info, "load_avg_1m_at_end": os.getloadavg()[0]},
        "baselines": {
            "hf-no-reuse": f"transformers generate, static batches of {args.hf_batch_size}, "
            "left padding, no KV reuse",
            "hf-prefix-cache": f"transformers generate, batches of up to {args.hf_batch_size} of "
            "one group, continuing from the group's prefix DynamicCache (deepcopy + repeat)",
        },
        "engine": {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "block_size": block_size,
        },
        "repeats": len(rounds["prefixserve"]),
        "wall_s_per_round": {name: [w for _, w in rs] for name, rs in rounds.items()},
        "systems": systems_summary,
        "prefix_cache": hit_rate(done, block_size),
        "hit_tokens_per_round": [
            sum(r.num_cached_tokens for r in d) for d, _ in rounds["prefixserve"]
        ],
        "cache_stats_all_rounds": engine.cache_stats(),
        "step_times_s": step_times[median["prefixserve"]],
        "ratios": {},
        "ratios_per_round": {},
        "agreement": {},
    }

    def tokens_per_s(run: tuple[list[BenchRequest], float]) -> float:
        return sum(len(r.output) for r in run[0]) / run[1]

    for name in runs:
        if name != "prefixserve":
            key = f"prefixserve/{name}"
            result["ratios"][key] = tokens_per_s(runs["prefixserve"]) / tokens_per_s(runs[name])
            result["ratios_per_round"][key] = [
                tokens_per_s(a) / tokens_per_s(b)
                for a, b in zip(rounds["prefixserve"], rounds[name])
            ]
            # the worst agreement over the baseline's rounds
            result["agreement"][name] = min(
                (agreement(done, d) for d, _ in rounds[name]), key=lambda a: a["requests_pct"]
            )
    return result


def save_and_print(result: dict, args: argparse.Namespace, stem: str, extra: str = "") -> dict:
    """Write ``<stem>.json`` and ``<stem>.png`` under ``--out-dir`` and print the summary line."""
    out_dir = Path(args.out_dir)
    wl = result["workload"]
    tag = " [QUICK: tiny sizes, not comparable to targets]" if args.quick else ""
    m = result["machine"]
    title = (
        f"{wl['name']}: {wl['description']} | {m['cores']}-core CPU, {m['torch_threads']} "
        f"threads, float32, bench model{tag}"
    )
    plot_result(result, title, out_dir / f"{stem}.png")
    write_json(result, out_dir / f"{stem}.json")
    print(
        f"workload: {wl['description']} | machine: {m['cores']}-core CPU ({m['cpu']}), "
        f"{m['torch_threads']} torch threads, float32, bench model | baselines: "
        + "; ".join(f"{k} = {v}" for k, v in result["baselines"].items())
    )
    ps = result["systems"]["prefixserve"]
    pc = result["prefix_cache"]
    parts = [
        f"{wl['name']}{tag}: prefixserve {ps['requests_per_s']:.2f} req/s "
        f"{ps['output_tokens_per_s']:.1f} tok/s TTFT p50 {ps['ttft_ms_p50']:.0f} ms",
        *(
            f"{k} {v:.2f}x [rounds {min(rr):.2f}-{max(rr):.2f}]"
            for k, v in result["ratios"].items()
            for rr in [result["ratios_per_round"][k]]
        ),
        f"hits {pc['hit_tokens']}/{pc['optimal_hit_tokens']} of optimum "
        f"({100 * pc['achieved_vs_optimum']:.1f}%)",
        *(f"agree {k} {v['requests_pct']:.0f}%" for k, v in result["agreement"].items()),
    ]
    if extra:
        parts.append(extra)
    print(
        " | ".join(parts)
        + f" | load {m['load_avg_1m_at_start']:.2f}->{m['load_avg_1m_at_end']:.2f}"
    )
    return result


def cached_vs_uncached_ttft(
    args: argparse.Namespace, prefix_tokens: int, question_len: int, repeats: int
) -> dict:
    """TTFT of one request whose prefix is cold, then of a new question on that prefix, warm."""
    engine = make_engine(ensure_checkpoint(args.model_dir))
    rng = random.Random(args.seed + 7)
    run_engine(engine, [BenchRequest("warmup", random_tokens(rng, 48), 1)])
    cold, warm = [], []
    for i in range(repeats):
        prefix = random_tokens(rng, prefix_tokens)
        a = BenchRequest(f"cold{i}", prefix + random_tokens(rng, question_len), 1)
        b = BenchRequest(f"warm{i}", prefix + random_tokens(rng, question_len), 1)
        run_engine(engine, [a])
        run_engine(engine, [b])
        cold.append(a.ttft)
        warm.append(b.ttft)
    c, w = statistics.median(cold), statistics.median(warm)
    return {
        "prefix_tokens": prefix_tokens,
        "question_tokens": question_len,
        "repeats": repeats,
        "ttft_ms_uncached": 1e3 * c,
        "ttft_ms_cached": 1e3 * w,
        "ratio": c / w,
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_comparison_args(__doc__.split("\n\n")[0], argv, {
        "groups": (4, 2), "prompts_per_group": (16, 4), "system_len": (1024, 128),
        "question_len": (32, 16), "output_len": (32, 8),
    })  # fmt: skip
    g, p, s, q, o = (
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        args.output_len,
    )
    rng = random.Random(args.seed)
    systems = [random_tokens(rng, s) for _ in range(g)]
    questions = [[random_tokens(rng, q) for _ in range(p)] for _ in range(g)]

    def make_requests() -> list[BenchRequest]:
        # Interleaved groups, as independent users would arrive.
        return [
            BenchRequest(f"g{i}-q{j}", systems[i] + questions[i][j], o, group=f"g{i}")
            for j in range(p)
            for i in range(g)
        ]

    workload = {
        "name": "shared_prefix",
        "description": f"G={g} groups x P={p} questions, system {s} + question {q} tokens, "
        f"{o} out, greedy, all submitted at once",
        "groups": g,
        "prompts_per_group": p,
        "system_len": s,
        "question_len": q,
        "output_len": o,
    }
    result = run_comparison(args, workload, make_requests, {f"g{i}": s for i in range(g)})
    ttft = cached_vs_uncached_ttft(args, s, q, repeats=1 if args.quick else 3)
    result["cached_vs_uncached_ttft"] = ttft
    return save_and_print(
        result,
        args,
        "shared_prefix",
        f"TTFT {s}-token prefix uncached/cached {ttft['ttft_ms_uncached']:.0f}/"
        f"{ttft['ttft_ms_cached']:.0f} ms = {ttft['ratio']:.1f}x",
    )


if __name__ == "__main__":
    main()
