"""Multi-turn tool-calling agents: prefixserve against transformers, side by side, on the bench model.

    python benchmarks/multi_turn_agents.py [--quick] [--agents 16] [--turns 4] [--system-len 1024]
        [--task-len 32] [--output-len 32] [--tool-len 64] [--hf-batch-size 16]

Workload: A agents share one system prompt of S random tokens; agent a's first prompt is the system
prompt plus its own task (``--task-len`` tokens). Each turn generates O tokens (greedy, EOS
ignored); the agent's next prompt is its previous prompt + that reply + a tool result of
``--tool-len`` seeded random tokens, for T turns. An agent submits its next turn the moment its
previous reply is complete; all agents start at once.
Machine: this CPU, float32, ``--threads`` torch threads for every system, one process.
Systems: prefixserve, ``hf-no-reuse`` and ``hf-prefix-cache`` (the shared system prompt prefilled
once; each turn's history is recomputed), as in ``hf_baselines.py``; a static batch takes the next
queued turns, so a follow-up turn waits for the batch it joins.

The optimum prefix-cache hits include the previous turn's reply (our cache registers generated
blocks). Writes ``multi_turn_agents.json`` / ``.png`` under ``--out-dir``.

Over HTTP against llama.cpp (``--http``, SmolLM2 on the same weights as ``benchmarks/decode
http``'s pairs): ``prefixserve serve`` and ``llama-server`` (``-np`` = agents slots, its prompt
cache on) run at once; the same agent workload as text (``http_load``'s ``agents``: a shared
system prompt of about ``--system-len`` tokens of words, each turn the history + reply + a tool
result, streamed greedy completions, every agent's next turn sent the moment its reply ends) goes
to one server, then the other, ``--rounds`` times. Reported: the median round's wall time, output
tokens/s and TTFT p50/p90 of each, and prefixserve's speed-up (llama.cpp's wall time /
prefixserve's).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from pathlib import Path

from bench_model import BenchRequest
from shared_prefix import parse_comparison_args, run_comparison, save_and_print
from workloads import random_tokens


def http(argv: list[str]) -> dict:
    """Both servers on one pair's weights, taking turns (see the module docstring)."""
    import http_load
    from decode.http import PAIRS
    from peers import llama_server as peer
    from report import write_json
    from workloads import parse_sizes

    parser = argparse.ArgumentParser(description="multi-turn agents over HTTP vs llama.cpp")
    parser.add_argument("--http", action="store_true")
    parser.add_argument("--pair", default="float32", choices=list(PAIRS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--quick", action="store_true")
    args = parse_sizes(parser, argv, {
        "agents": (8, 2), "turns": (4, 2), "system_len": (1024, 64), "question_len": (32, 8),
        "tool_len": (64, 8), "output_len": (32, 4),
    })  # fmt: skip
    options, ftype, _ = PAIRS[args.pair]
    shipped = peer.smollm2_gguf()
    ctx = 2 * (args.system_len + args.turns * (args.question_len + args.tool_len + args.output_len))
    ps_port, ll_port = peer.free_port(), peer.free_port()
    ps_cmd = peer.prefixserve_command(shipped, ps_port, max_num_seqs=args.agents,
                                      extra=[*options, "--max-model-len", str(ctx)])  # fmt: skip
    ll_cmd = peer.llama_server_command(
        peer.require_binary("llama-server"), peer.gguf_of_type(shipped, ftype), ll_port,
        threads=args.threads, parallel=args.agents, ctx_per_slot=ctx)  # fmt: skip
    load = argparse.Namespace(
        workload="agents", prompt_format="text", request_rate=float("inf"), concurrency=0,
        timeout=600.0, model=None, seed=args.seed, **{k: getattr(args, k) for k in (
            "agents", "turns", "system_len", "question_len", "tool_len", "output_len")})  # fmt: skip
    runs: dict[str, list[dict]] = {"prefixserve": [], "llama.cpp": []}
    with (
        peer.running(ps_cmd, ps_port, env=peer.server_env(args.threads)) as ps_base,
        peer.running(ll_cmd, ll_port) as ll_base,
    ):
        bases = {"prefixserve": ps_base, "llama.cpp": ll_base}
        for r in range(args.rounds):
            for system, base in bases.items():
                load.base_url, load.seed = base, args.seed + r  # new prompts each round
                load.no_metrics = system != "prefixserve"
                summary = http_load.summarize_load(asyncio.run(http_load.run_load(load)))
                if summary["requests_failed"]:
                    raise RuntimeError(f"{system}: {summary['errors']}")
                runs[system].append({k: v for k, v in summary.items() if not k.startswith("_")})
    median = {s: {"wall_s": statistics.median(x["wall_s"] for x in v),
                  "output_tokens_per_s": statistics.median(x["output_tokens_per_s"] for x in v),
                  "ttft_p50_ms": statistics.median(x["ttft_ms"]["p50"] for x in v),
                  "ttft_p90_ms": statistics.median(x["ttft_ms"]["p90"] for x in v),
                  "retries": sum(x["retries"] for x in v)}
              for s, v in runs.items()}  # fmt: skip
    speedup = median["llama.cpp"]["wall_s"] / median["prefixserve"]["wall_s"]
    for system, m in median.items():
        print(f"{system:12s} wall {m['wall_s']:.1f} s, {m['output_tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {m['ttft_p50_ms']:.0f} ms p90 {m['ttft_p90_ms']:.0f} ms, "
              f"{m['retries']} requests retried")  # fmt: skip
    print(f"prefixserve speed-up over llama.cpp ({args.agents} agents x {args.turns} turns, "
          f"{args.pair}/{ftype}): {speedup:.2f}x")  # fmt: skip
    result = {"mode": "http", "pair": args.pair, "llama_cpp_type": ftype, "agents": args.agents,
              "turns": args.turns, "system_len": args.system_len, "rounds": runs,
              "median": median, "speedup": speedup}  # fmt: skip
    write_json(result, Path(args.out_dir) / "multi_turn_agents_http.json")
    return result


def main(argv: list[str] | None = None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--http" in argv:
        return http(argv)
    args = parse_comparison_args(__doc__.split("\n\n")[0], argv, {
        "agents": (16, 4), "turns": (4, 2), "system_len": (1024, 128), "task_len": (32, 16),
        "output_len": (32, 8), "tool_len": (64, 16),
    })  # fmt: skip
    rng = random.Random(args.seed)
    system = random_tokens(rng, args.system_len)
    tasks = [random_tokens(rng, args.task_len) for _ in range(args.agents)]

    def make_requests() -> list[BenchRequest]:
        return [
            BenchRequest(f"a{a}-t0", system + tasks[a], args.output_len, group="system")
            for a in range(args.agents)
        ]

    def next_turn(done: BenchRequest) -> BenchRequest | None:
        agent, turn = (int(part[1:]) for part in done.request_id.split("-"))
        if turn + 1 >= args.turns:
            return None
        tool = random_tokens(random.Random(f"{args.seed}/{agent}/{turn}"), args.tool_len)
        return BenchRequest(
            f"a{agent}-t{turn + 1}", done.prompt + done.output + tool, args.output_len, "system"
        )

    workload = {
        "name": "multi_turn_agents",
        "description": f"A={args.agents} agents x T={args.turns} turns, system {args.system_len} "
        f"+ task {args.task_len}, each turn +{args.output_len} reply +{args.tool_len} tool tokens",
        "agents": args.agents,
        "turns": args.turns,
        "system_len": args.system_len,
        "task_len": args.task_len,
        "output_len": args.output_len,
        "tool_len": args.tool_len,
    }
    result = run_comparison(
        args, workload, make_requests, {"system": args.system_len}, follow_up=next_turn
    )
    return save_and_print(result, args, "multi_turn_agents")


if __name__ == "__main__":
    main()
