"""Serving metrics, figures and the results table shared by the benchmarks.

    python benchmarks/report.py [--results-dir benchmarks/results] [--out table.md]

As a script it collects every ``*.json`` result that holds a ``systems`` section into one markdown
table (workload, system, requests/s, output tokens/s, TTFT p50/p99, TPOT p50, hit rate vs optimum)
for docs/benchmarks.md, printed and written to ``--out`` (default ``results/README_table.md``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from bench_model import RESULTS_DIR, BenchRequest


def summarize(done: list[BenchRequest], wall_s: float) -> dict:
    """Throughput and latency of one system's run (times in milliseconds)."""
    ttft = np.array([r.ttft for r in done]) * 1e3
    tpots = [r.tpot for r in done if r.tpot is not None]
    tpot = np.array(tpots) * 1e3 if tpots else np.array([0.0])
    out_tokens = sum(len(r.output) for r in done)
    return {
        "requests": len(done),
        "output_tokens": out_tokens,
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s,
        "output_tokens_per_s": out_tokens / wall_s,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "tpot_ms_p50": float(np.percentile(tpot, 50)),
        "tpot_ms_p99": float(np.percentile(tpot, 99)),
    }


def optimal_hit_tokens(done: list[BenchRequest], block_size: int) -> int:
    """Prompt tokens an ideal prefix cache of unlimited size would serve for this run.

    Per request, as our cache: the full blocks of the longest prefix it shares with an earlier
    request (the earlier prompt, or its prompt + output when it finished before this one was
    submitted; the last output token has no KV), then, from a finished request whose computed
    tokens end in the next block, as much of that partial block as the prompt shares (a partial
    tail, ``prefixserve.kv.partial_tail``); in all at most ``len(prompt) - 1`` tokens.
    """
    trie: dict = {}
    tails = "tails"  # a node's key for the partial tails after it (block keys are tuples)

    def insert(tokens: list[int], tail: bool = False) -> None:
        node = trie
        for i in range(len(tokens) // block_size):
            node = node.setdefault(tuple(tokens[i * block_size : (i + 1) * block_size]), {})
        rest = tokens[len(tokens) // block_size * block_size :]
        if tail and rest:
            node.setdefault(tails, []).append(rest)

    def match(tokens: list[int]) -> int:
        node, n = trie, 0
        for i in range((len(tokens) - 1) // block_size):
            child = node.get(tuple(tokens[i * block_size : (i + 1) * block_size]))
            if child is None:
                break
            node, n = child, n + block_size
        rest = tokens[n : min(n + block_size - 1, len(tokens) - 1)]
        return n + max((_common_prefix(t, rest) for t in node.get(tails, ())), default=0)

    by_finish = sorted(done, key=lambda r: r.finish_time or 0.0)
    finished_upto = 0
    total = 0
    for req in sorted(done, key=lambda r: r.submit_time):
        while (
            finished_upto < len(by_finish)
            and (by_finish[finished_upto].finish_time or 0.0) <= req.submit_time
        ):
            prev = by_finish[finished_upto]
            insert(prev.prompt + prev.output[:-1], tail=True)
            finished_upto += 1
        total += match(req.prompt)
        insert(req.prompt)
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def hit_rate(done: list[BenchRequest], block_size: int) -> dict:
    """Achieved prefix-cache hits (``num_cached_tokens``) against the workload's optimum."""
    prompt_tokens = sum(len(r.prompt) for r in done)
    achieved = sum(r.num_cached_tokens for r in done)
    optimum = optimal_hit_tokens(done, block_size)
    return {
        "prompt_tokens": prompt_tokens,
        "hit_tokens": achieved,
        "optimal_hit_tokens": optimum,
        "hit_rate": achieved / prompt_tokens if prompt_tokens else 0.0,
        "optimal_hit_rate": optimum / prompt_tokens if prompt_tokens else 0.0,
        "achieved_vs_optimum": achieved / optimum if optimum else 1.0,
    }


def agreement(reference: list[BenchRequest], other: list[BenchRequest]) -> dict:
    """How many requests (by id) got the same greedy tokens, and the share of matching tokens."""
    ref = {r.request_id: r.output for r in reference}
    same_req = same_tok = total_tok = 0
    for r in other:
        want = ref[r.request_id]
        same_req += want == r.output
        same_tok += sum(a == b for a, b in zip(want, r.output))
        total_tok += len(want)
    return {
        "requests_compared": len(other),
        "requests_pct": 100.0 * same_req / len(other) if other else 0.0,
        "tokens_pct": 100.0 * same_tok / total_tok if total_tok else 0.0,
    }


def _bars(ax, labels: list[str], series: dict[str, list[float]], title: str) -> None:
    """Grouped bars: one group per label, one bar per series, values printed on the bars."""
    x = np.arange(len(labels))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (k - (len(series) - 1) / 2) * width, values, width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(x, labels, rotation=15, fontsize=8)
    ax.set_title(title, fontsize=9)
    if len(series) > 1:
        ax.legend(fontsize=7)


def plot_result(result: dict, title: str, path: Path) -> Path:
    """Top row, per system: requests/s, output tokens/s, TTFT p50/p99, TPOT p50. Bottom row:
    throughput ratios, prefixserve's hit rate against the optimum, cached vs uncached TTFT."""
    systems = result["systems"]
    names = list(systems)
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
    top = (
        ("requests/s", ["requests_per_s"]),
        ("output tokens/s", ["output_tokens_per_s"]),
        ("TTFT (ms)", ["ttft_ms_p50", "ttft_ms_p99"]),
        ("TPOT (ms)", ["tpot_ms_p50"]),
    )
    for ax, (label, keys) in zip(axes[0], top):
        _bars(ax, names, {k: [systems[n][k] for n in names] for k in keys}, label)
    ratios = result.get("ratios") or {}
    if ratios:
        _bars(axes[1][0], list(ratios), {"x": list(ratios.values())}, "throughput ratio")
        axes[1][0].axhline(1.0, color="grey", lw=0.8)
    pc = result["prefix_cache"]
    _bars(
        axes[1][1],
        ["achieved", "optimum"],
        {"hit rate %": [100 * pc["hit_rate"], 100 * pc["optimal_hit_rate"]]},
        f"prefix-cache hit rate ({100 * pc['achieved_vs_optimum']:.1f}% of optimum)",
    )
    pair = result.get("cached_vs_uncached_ttft")
    if pair:
        _bars(
            axes[1][2],
            ["uncached", "cached"],
            {"TTFT ms": [pair["ttft_ms_uncached"], pair["ttft_ms_cached"]]},
            f"TTFT, {pair['prefix_tokens']}-token prefix ({pair['ratio']:.1f}x)",
        )
    for ax in axes[1]:
        if not ax.has_data():
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def table(results: list[dict]) -> str:
    """One markdown row per (workload, system)."""
    lines = [
        "| workload | system | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 (ms) | hits/optimum |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in results:
        label = res["workload"]["name"] + (" (quick)" if res.get("quick") else "")
        hits = res.get("prefix_cache", {}).get("achieved_vs_optimum")
        for name, s in res["systems"].items():
            hit_cell = f"{100 * hits:.1f}%" if hits is not None and name == "prefixserve" else ""
            lines.append(
                f"| {label} | {name} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} "
                f"| {s['ttft_ms_p50']:.0f} / {s['ttft_ms_p99']:.0f} | {s['tpot_ms_p50']:.1f} "
                f"| {hit_cell} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument(
        "--out", default=None, help="markdown file (default results/README_table.md)"
    )
    parser.add_argument("--quick", action="store_true", help="accepted for symmetry")
    args = parser.parse_args(argv)
    folder = Path(args.results_dir)
    results = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "systems" in data and "workload" in data:
            results.append(data)
    text = table(results)
    out = Path(args.out) if args.out else folder / "README_table.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
