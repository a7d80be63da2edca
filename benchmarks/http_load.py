"""HTTP load generator against a running ``prefixserve serve``: TTFT, ITL, throughput, hit rate.

    prefixserve serve --model benchmarks/results/bench-model --port 8000 &
    python benchmarks/http_load.py --base-url http://127.0.0.1:8000 [--workload shared_prefix]
        [--request-rate 4 | --concurrency 16] [--prompt-format ids|text] [--quick]

Workloads: ``shared_prefix`` (G groups x P questions, system S + question Q tokens, O out, as
``shared_prefix.py``) or ``agents`` (A agents sharing a system prompt, T turns, each turn resending
the history + reply + a tool result, as ``multi_turn_agents.py``). Prompts go to ``/v1/completions``
as token ids (default; an agent's reply is turned back into ids through ``/tokenize``) or as
text (seeded random words), streamed, greedy, ``ignore_eos``.
Arrivals: Poisson at ``--request-rate`` requests/s (an agent's first turn arrives so; its later
turns follow its previous reply), or all at once; ``--concurrency`` caps requests in flight.
Each client is an ``httpx.AsyncClient`` stream: TTFT is the time to the first streamed token
chunk, ITL the gaps between chunks. The prefix-cache hit rate is the delta of
``prefixserve_prefix_cache_hits_total / prefixserve_prefix_cache_queries_total`` on ``/metrics``.
Machine: whatever the server runs on (stated by the server's operator); the client is this host.
Baseline: none in this script; run the same command against another server (``transformers
serve``, ``llama-server``) with ``--no-metrics`` to compare.

Writes ``http_load.json`` / ``.png`` under ``--out-dir`` and prints one summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from bench_model import RESULTS_DIR
from report import save_figure, write_json
from workloads import WORDS, parse_sizes, random_tokens

MAX_RETRIES = 2  # the OpenAI SDK's default max_retries


@dataclass
class Turn:
    """One streamed completion and its timings (``time.perf_counter`` seconds)."""

    client: int
    turn: int
    prompt: list[int] | str
    submit: float = 0.0
    chunks: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    retries: int = 0


def make_prompt(rng: random.Random, n: int, fmt: str) -> list[int] | str:
    """``n`` random token ids, or about ``n`` tokens of random words."""
    if fmt == "ids":
        return random_tokens(rng, n)
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n // 2)))


async def stream_completion(
    client: httpx.AsyncClient, model: str, turn: Turn, max_tokens: int
) -> None:
    """POST one streamed completion; fills ``turn``'s timings, text and usage. A connection the
    server closed before answering (a pooled keep-alive connection it was dropping) is retried
    on a fresh one, up to ``MAX_RETRIES`` times, as the OpenAI SDK retries connection errors;
    the turn's time runs from the first try, and ``turn.retries`` counts them."""
    body = {
        "model": model,
        "prompt": turn.prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    turn.submit = time.perf_counter()
    while True:
        try:
            await _stream_once(client, body, turn)
            return
        except httpx.RemoteProtocolError:
            if turn.chunks or turn.retries == MAX_RETRIES:  # a reply had begun: not retried
                raise
            turn.retries += 1


async def _stream_once(client: httpx.AsyncClient, body: dict, turn: Turn) -> None:
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            turn.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                turn.error = str(event["error"])[:200]
                break
            if event.get("usage"):
                turn.completion_tokens = event["usage"]["completion_tokens"]
                details = event["usage"].get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens") or 0
            for choice in event.get("choices", []):
                turn.chunks.append(time.perf_counter())
                turn.text += choice.get("text") or ""


async def tokenize(client: httpx.AsyncClient, model: str, text: str) -> list[int]:
    """The server's token ids for ``text`` (no BOS), to extend an id prompt with a reply."""
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    resp = await client.post("/tokenize", json=body)
    resp.raise_for_status()
    return resp.json()["tokens"]


async def read_cache_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(queries, hits) from /metrics, or None when the server does not export them."""
    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for line in resp.text.splitlines():
        for name in ("prefixserve_prefix_cache_queries", "prefixserve_prefix_cache_hits"):
            if line.startswith(name + "_total") or line.startswith(name + "{"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    if len(values) < 2:
        return None
    return values["prefixserve_prefix_cache_queries"], values["prefixserve_prefix_cache_hits"]


async def run_load(args: argparse.Namespace) -> dict:
    """Drive the workload; returns per-turn records and wall time."""
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency or 1000)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        before = None if args.no_metrics else await read_cache_counters(client)
        sem = asyncio.Semaphore(args.concurrency) if args.concurrency else None
        turns: list[Turn] = []
        if args.workload == "shared_prefix":
            systems = [
                make_prompt(rng, args.system_len, args.prompt_format) for _ in range(args.groups)
            ]
            plans = [
                [_join(systems[g], make_prompt(rng, args.question_len, args.prompt_format))]
                for _ in range(args.prompts_per_group)
                for g in range(args.groups)
            ]
        else:
            system = make_prompt(rng, args.system_len, args.prompt_format)
            plans = [
                [_join(system, make_prompt(rng, args.question_len, args.prompt_format))]
                for _ in range(args.agents)
            ]

        async def run_client(index: int, delay: float) -> None:
            await asyncio.sleep(delay)
            prompt = plans[index][0]
            num_turns = args.turns if args.workload == "agents" else 1
            for t in range(num_turns):
                turn = Turn(index, t, prompt)
                turns.append(turn)
                if sem is not None:
                    async with sem:
                        await stream_completion(client, model, turn, args.output_len)
                else:
                    await stream_completion(client, model, turn, args.output_len)
                if turn.error or t + 1 == num_turns:
                    return
                tool = make_prompt(
                    random.Random(f"{args.seed}/{index}/{t}"), args.tool_len, args.prompt_format
                )
                if isinstance(prompt, str):
                    prompt = f"{prompt}{turn.text} {tool}"
                else:
                    prompt = prompt + await tokenize(client, model, turn.text) + tool

        delays, clock = [], 0.0
        for _ in plans:
            delays.append(clock)
            if args.request_rate != float("inf"):
                clock += rng.expovariate(args.request_rate)
        start = time.perf_counter()
        await asyncio.gather(*(run_client(i, d) for i, d in enumerate(delays)))
        wall = time.perf_counter() - start
        after = None if args.no_metrics else await read_cache_counters(client)
    return {"model": model, "turns": turns, "wall_s": wall, "before": before, "after": after}


def _join(a: list[int] | str, b: list[int] | str) -> list[int] | str:
    return f"{a} {b}" if isinstance(a, str) else a + b


def summarize_load(run: dict) -> dict:
    """Throughput, TTFT / ITL percentiles (ms) and the /metrics hit rate of one load run."""
    turns: list[Turn] = run["turns"]
    ok = [t for t in turns if t.error is None and t.chunks]
    ttft = np.array([t.chunks[0] - t.submit for t in ok] or [0.0]) * 1e3
    itl = np.array([b - a for t in ok for a, b in zip(t.chunks, t.chunks[1:])] or [0.0]) * 1e3
    out_tokens = sum(t.completion_tokens or len(t.chunks) for t in ok)
    hit = None
    if run["before"] is not None and run["after"] is not None:
        dq = run["after"][0] - run["before"][0]
        dh = run["after"][1] - run["before"][1]
        hit = {"queries": dq, "hits": dh, "hit_rate": dh / dq if dq else 0.0}

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q))

    return {
        "requests_ok": len(ok),
        "requests_failed": len(turns) - len(ok),
        "errors": sorted({t.error for t in turns if t.error})[:5],
        "retries": sum(t.retries for t in turns),
        "wall_s": run["wall_s"],
        "requests_per_s": len(ok) / run["wall_s"],
        "output_tokens_per_s": out_tokens / run["wall_s"],
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "itl_ms": {"p50": pct(itl, 50), "p90": pct(itl, 90), "p99": pct(itl, 99)},
        "cached_tokens_reported": sum(t.cached_tokens for t in ok),
        "metrics_prefix_cache": hit,
        "_ttft": ttft.tolist(),
        "_itl": itl.tolist(),
    }


def plot_load(summary: dict, title: str, path: Path) -> Path:
    """CDFs of TTFT and ITL."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, label in ((axes[0], "_ttft", "TTFT (ms)"), (axes[1], "_itl", "ITL (ms)")):
        values = np.sort(np.array(summary[key]))
        ax.plot(values, np.arange(1, len(values) + 1) / len(values))
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if key == "_ttft" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--workload", choices=["shared_prefix", "agents"], default="shared_prefix")
    parser.add_argument("--prompt-format", choices=["ids", "text"], default="ids")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson, req/s")
    parser.add_argument("--concurrency", type=int, default=0, help="max in flight (0: no cap)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--no-metrics", action="store_true", help="server has no prefixserve /metrics"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    args = parse_sizes(parser, argv, {
        "groups": (4, 2), "prompts_per_group": (16, 2), "agents": (16, 2), "turns": (4, 2),
        "system_len": (1024, 64), "question_len": (32, 8), "tool_len": (64, 8),
        "output_len": (32, 4),
    })  # fmt: skip
    run = asyncio.run(run_load(args))
    summary = summarize_load(run)
    shape = (
        f"{args.groups}x{args.prompts_per_group} prompts, system {args.system_len} + "
        f"{args.question_len}"
        if args.workload == "shared_prefix"
        else f"{args.agents} agents x {args.turns} turns, system {args.system_len}, "
        f"tool {args.tool_len}"
    )
    arrivals = (
        f"Poisson {args.request_rate}/s" if args.request_rate != float("inf") else "all at once"
    ) + (f", concurrency {args.concurrency}" if args.concurrency else "")
    tag = " [QUICK]" if args.quick else ""
    result = {
        "workload": {
            "name": f"http_{args.workload}",
            "description": f"{shape}, {args.output_len} out, {args.prompt_format} prompts, "
            f"{arrivals}",
        },
        "quick": args.quick,
        "server": {"base_url": args.base_url, "model": run["model"]},
        "summary": {k: v for k, v in summary.items() if not k.startswith("_")},
    }
    out_dir = Path(args.out_dir)
    write_json(result, out_dir / "http_load.json")
    plot_load(
        summary,
        f"{result['workload']['name']}: {result['workload']['description']}{tag}",
        out_dir / "http_load.png",
    )
    hit = summary["metrics_prefix_cache"]
    hit_text = f"hit rate {100 * hit['hit_rate']:.1f}% (/metrics)" if hit else "hit rate n/a"
    print(
        f"http_load{tag} {args.workload} ({arrivals}): {summary['requests_ok']} ok "
        f"{summary['requests_failed']} failed | {summary['requests_per_s']:.2f} req/s "
        f"{summary['output_tokens_per_s']:.1f} tok/s | TTFT p50/p99 "
        f"{summary['ttft_ms']['p50']:.0f}/{summary['ttft_ms']['p99']:.0f} ms | ITL p50/p99 "
        f"{summary['itl_ms']['p50']:.1f}/{summary['itl_ms']['p99']:.1f} ms | {hit_text}"
    )
    return result


if __name__ == "__main__":
    main()
