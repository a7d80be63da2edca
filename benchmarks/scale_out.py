"""Scale-out on one machine: two engine replicas on Ray Serve, routed by prefix, pow2, Ray's
prefix-affinity router, against a single replica, side by side in one run, in rounds.

    python benchmarks/scale_out.py [--quick] [--rounds 2] [--groups 6] [--requests 96]
        [--concurrency 8] [--system-len 1024] [--pool-prefixes 4.5] [--replica-num-cpus 1]

Workload: G groups, each a ``--system-len``-token system prompt (random token ids), every request
that prompt plus its own ``--question-len``-token question, ``--output-len`` tokens out (greedy,
EOS ignored), streamed from /v1/completions with the groups interleaved (g0, g1, ..., g0, ...),
``--concurrency`` requests in flight. Each replica's KV pool holds ``--pool-prefixes`` system
prompts (plus room for the requests in flight): fewer than G, so one replica must evict and
recompute, but two hold them all when each keeps its own groups.
Systems: ``prefix`` (ours), ``pow2`` (Ray's default), ``ray-prefix`` (Ray's
PrefixCacheAffinityRouter), each with two replicas, and ``single`` (one replica, same ingress).
Every run starts from a fresh deployment (empty caches). Machine: this host (all replicas, the
ingress, Serve's proxy and the client share its cores); model: the bench checkpoint, float32,
one torch thread per replica.
Reported per system (its median round by wall time): requests/s, output tokens/s, TTFT p50/p99,
prefix-cache hits against the optimum (every request but the first of its group hits the whole
system prompt), requests and prompt tokens per replica. Writes ``scale_out.json`` / ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import time
from pathlib import Path

import httpx
from bench_model import RESULTS_DIR, BenchRequest, ensure_checkpoint, machine
from http_load import Turn, stream_completion
from report import hit_rate, plot_result, summarize, write_json
from workloads import parse_sizes, random_tokens

SYSTEMS = ("prefix", "pow2", "ray-prefix", "single")
BLOCK_SIZE = 16
MODEL = "bench"
TARGETS = {
    "prefix/pow2 throughput": 1.8,
    "prefix/ray-prefix throughput": 1.0,
    "prefix hits vs optimum": 0.95,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke run")
    p.add_argument("--rounds", type=int, default=None, help="default 2 (1 with --quick)")
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--replica-num-cpus", type=float, default=1.0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--model-dir", default=None, help="default: the bench checkpoint")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    p.add_argument("--seed", type=int, default=0)
    args = parse_sizes(p, argv, {
        "groups": (6, 4), "requests": (96, 24), "concurrency": (8, 4), "system_len": (1024, 256),
        "pool_prefixes": (4.5, 3.0),
    })  # fmt: skip
    args.rounds = args.rounds or (1 if args.quick else 2)
    return args


def pool_blocks(args: argparse.Namespace) -> int:
    """Per replica: ``pool_prefixes`` system prompts, plus each in-flight request's own blocks."""
    own = math.ceil((args.question_len + args.output_len) / BLOCK_SIZE) + 1
    return math.ceil(args.pool_prefixes * args.system_len / BLOCK_SIZE) + args.concurrency * own


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    rng = random.Random(args.seed)
    systems = [random_tokens(rng, args.system_len) for _ in range(args.groups)]
    return [
        BenchRequest(
            f"r{i}",
            systems[i % args.groups] + random_tokens(rng, args.question_len),
            args.output_len,
            group=f"g{i % args.groups}",
        )
        for i in range(args.requests)
    ]


# --- one system ------------------------------------------------------------------------------------


def deploy(args: argparse.Namespace, system: str, base: str, app_name: str) -> None:
    """A fresh application under its own name: Ray's PrefixCacheAffinityRouter keeps its tree in
    a detached actor per application, which a redeploy under the same name would inherit."""
    from ray import serve

    from prefixserve.api.server import ServerConfig
    from prefixserve.scale_out.deployments import ScaleOutConfig, build_application

    engine = dict(
        model=str(args.model_dir),
        num_kv_blocks=pool_blocks(args),
        max_model_len=4096,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
    )
    replicas = 1 if system == "single" else 2
    router = "pow2" if system == "single" else system
    scale = ScaleOutConfig(
        replicas=replicas,
        router=router,
        replica_num_cpus=args.replica_num_cpus,
        stats_period_s=0.5,
        app_name=app_name,
    )
    app = build_application(engine, ServerConfig(served_model_names=[MODEL]), scale)
    serve.run(app, name=scale.app_name, route_prefix="/", logging_config={"log_level": "WARNING"})
    deadline = time.monotonic() + 120
    while len(httpx.get(f"{base}/stats", timeout=10).json()["replicas"]) != replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{system}: the replicas did not report")
        time.sleep(0.3)


async def stream_one(client: httpx.AsyncClient, req: BenchRequest) -> None:
    """``req`` as one streamed completion (``http_load``'s client); fills its times and usage."""
    turn = Turn(0, 0, req.prompt)
    await stream_completion(client, MODEL, turn, req.max_tokens)
    if turn.error is not None:
        raise RuntimeError(f"{req.request_id}: {turn.error}")
    req.submit_time, req.finish_time = turn.submit, time.perf_counter()
    req.first_token_time = turn.chunks[0] if turn.chunks else None
    req.num_cached_tokens = turn.cached_tokens
    req.output = [-1] * turn.completion_tokens  # ids are not needed here


async def drive(base: str, requests: list[BenchRequest], concurrency: int) -> float:
    """Send ``requests`` in order, at most ``concurrency`` in flight; the wall time."""
    queue = list(reversed(requests))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                await stream_one(client, queue.pop())

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def run_system(args: argparse.Namespace, system: str, base: str, app_name: str) -> dict:
    from ray import serve

    deploy(args, system, base, app_name)
    warm = [BenchRequest(f"warm{i}", [5 + i] * 40, 2) for i in range(2)]
    asyncio.run(drive(base, warm, 2))
    requests = make_requests(args)
    wall = asyncio.run(drive(base, requests, args.concurrency))
    stats = httpx.get(f"{base}/stats", timeout=10).json()
    serve.delete(app_name)
    per_replica = [
        {
            "replica": r["replica"],
            "requests": sum(r["router"].get("requests", {}).values()),
            "requests_by_reason": r["router"].get("requests", {}),
            "prompt_tokens": r["prompt_tokens"],
            "prefix_cache_hits": r["prefix_cache_hits"],
            "evictions": r["evictions"],
            "generation_tokens": r["generation_tokens"],
        }
        for r in stats["replicas"]
    ]
    return {
        "wall_s": wall,
        "summary": summarize(requests, wall),
        "prefix_cache": hit_rate(requests, BLOCK_SIZE),
        "per_replica": per_replica,
    }


# --- the comparison ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.model_dir = Path(args.model_dir) if args.model_dir else ensure_checkpoint()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    import ray
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cpus = max(os.cpu_count() or 1, math.ceil(2 * args.replica_num_cpus))
    ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    try:
        serve.start(
            http_options={"host": "127.0.0.1", "port": port},
            logging_config={"log_level": "WARNING"},
        )
        for r in range(args.rounds):
            for name in systems:
                run = run_system(args, name, base, f"bench-{name}-{r}")
                rounds[name].append(run)
                s, pc = run["summary"], run["prefix_cache"]
                print(
                    f"round {r} {name:>10}: {s['requests_per_s']:.2f} req/s, "
                    f"TTFT p50 {s['ttft_ms_p50']:.0f} ms, hits/optimum "
                    f"{100 * pc['achieved_vs_optimum']:.1f}%",
                    flush=True,
                )
    finally:
        serve.shutdown()
        ray.shutdown()
    result = summarize_rounds(args, rounds)
    save_and_print(args, result)
    return result


def summarize_rounds(args: argparse.Namespace, rounds: dict[str, list[dict]]) -> dict:
    median = {
        name: sorted(runs, key=lambda run: run["wall_s"])[len(runs) // 2]
        for name, runs in rounds.items()
    }

    def ratio(a: str, b: str, key: str = "output_tokens_per_s") -> float | None:
        if a not in median or b not in median:
            return None
        return median[a]["summary"][key] / median[b]["summary"][key]

    ratios = {f"prefix/{b}": ratio("prefix", b) for b in median if b != "prefix"}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    per_round = {
        f"prefix/{b}": [
            a["summary"]["output_tokens_per_s"] / c["summary"]["output_tokens_per_s"]
            for a, c in zip(rounds["prefix"], rounds[b])
        ]
        for b in rounds
        if b != "prefix" and "prefix" in rounds
    }
    checks = {}
    if "prefix" in median:
        prefix_hits = median["prefix"]["prefix_cache"]["achieved_vs_optimum"]
        checks["prefix hits vs optimum"] = prefix_hits
        for b, key in (
            ("pow2", "prefix/pow2 throughput"),
            ("ray-prefix", "prefix/ray-prefix throughput"),
        ):
            if b in median:
                checks[key] = ratios[f"prefix/{b}"]
        if "ray-prefix" in median:
            ray_hits = median["ray-prefix"]["prefix_cache"]["achieved_vs_optimum"]
            checks["prefix/ray-prefix hits"] = prefix_hits / ray_hits if ray_hits else math.inf
    return {
        "workload": {
            "name": "scale_out",
            "description": f"G={args.groups} groups, system {args.system_len} + question "
            f"{args.question_len} tokens, {args.output_len} out, {args.requests} requests "
            f"interleaved, {args.concurrency} in flight; pool {pool_blocks(args)} blocks/replica "
            f"(~{args.pool_prefixes} system prompts)",
            **{
                k: getattr(args, k)
                for k in (
                    "groups",
                    "requests",
                    "concurrency",
                    "system_len",
                    "question_len",
                    "output_len",
                    "pool_prefixes",
                )
            },
        },
        "quick": args.quick,
        "machine": {
            **machine(),
            "replica_num_cpus": args.replica_num_cpus,
            "torch_threads_per_replica": max(1, int(args.replica_num_cpus)),
        },
        "baselines": {
            "pow2": "Ray Serve's default power-of-two-choices router, two replicas",
            "ray-prefix": "Ray Serve LLM's PrefixCacheAffinityRouter, two replicas",
            "single": "one replica behind the same ingress",
        },
        "rounds": args.rounds,
        "wall_s_per_round": {n: [run["wall_s"] for run in runs] for n, runs in rounds.items()},
        "hits_vs_optimum_per_round": {
            n: [run["prefix_cache"]["achieved_vs_optimum"] for run in runs]
            for n, runs in rounds.items()
        },
        "systems": {n: run["summary"] for n, run in median.items()},
        "hits": {n: run["prefix_cache"] for n, run in median.items()},
        "per_replica": {n: run["per_replica"] for n, run in median.items()},
        "requests_per_replica_per_round": {
            n: [[r["requests"] for r in run["per_replica"]] for run in runs]
            for n, runs in rounds.items()
        },
        "prefix_cache": median.get("prefix", next(iter(median.values())))["prefix_cache"],
        "ratios": ratios,
        "ratios_per_round": per_round,
        "targets": TARGETS,
        "checks": checks,
    }


def save_and_print(args: argparse.Namespace, result: dict) -> None:
    out = Path(args.out_dir)
    tag = " [QUICK: tiny sizes, not comparable to targets]" if args.quick else ""
    m = result["machine"]
    title = (
        f"scale_out: {result['workload']['description']} | {m['cores']}-core CPU, "
        f"{m['torch_threads_per_replica']} thread/replica, bench model{tag}"
    )
    plot_result(result, title, out / "scale_out.png")
    write_json(result, out / "scale_out.json")
    print(f"\nworkload: {result['workload']['description']}")
    print(f"machine: {m['cores']}-core CPU ({m['cpu']}); every process shares it{tag}")
    print(
        "| system | req/s | out tok/s | TTFT p50 / p99 (ms) | hit rate | hits/optimum | "
        "requests per replica |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, s in result["systems"].items():
        pc = result["hits"][name]
        load = " / ".join(str(r["requests"]) for r in result["per_replica"][name])
        print(
            f"| {name} | {s['requests_per_s']:.2f} | {s['output_tokens_per_s']:.1f} | "
            f"{s['ttft_ms_p50']:.0f} / {s['ttft_ms_p99']:.0f} | {100 * pc['hit_rate']:.1f}% | "
            f"{100 * pc['achieved_vs_optimum']:.1f}% | {load} |"
        )
    for name, splits in result["requests_per_replica_per_round"].items():
        print(f"{name} requests per replica, per round: " + ", ".join(map(str, splits)))
    for key, values in result["ratios_per_round"].items():
        print(f"{key} throughput per round: " + ", ".join(f"{v:.2f}" for v in values))
    for key, value in result["checks"].items():
        target = TARGETS.get(key)
        verdict = ""
        if target is not None:
            verdict = f" (target >= {target:.2f}: {'met' if value >= target else 'MISSED'})"
        print(f"{key}: {value:.2f}{verdict}")


if __name__ == "__main__":
    main()
