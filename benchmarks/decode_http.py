"""Decode tokens/s over HTTP beside offline ``LLM.generate``-style stepping, in one run.

    python benchmarks/decode_http.py [--model smollm2] [--streams 1 8] [--runs 3]
        [--max-tokens 64] [--server-threads 2]

Workload: N streams (``--streams``) with distinct 32-token prompts (token ids), greedy, EOS
ignored, ``--max-tokens`` each, all sent at once. HTTP: a ``prefixserve serve`` subprocess
(float32, the GGUF dequantized) on 127.0.0.1 and a free port; each stream is a streamed
``/v1/completions`` request from an ``httpx`` client in this process. Offline: the same engine
configuration in this process, stepped by hand while the server idles. Measured for both: the
decode rate, tokens generated after every stream's first token divided by the time from that
moment to the last token; median of ``--runs`` runs, HTTP and offline taking turns so that a busy
minute on a shared machine hits both. Printed: the two medians and their ratio (the issue-22
target is HTTP >= 95% of offline). Machine: this one, CPU; the client shares its cores with the
server, as a benchmark client on a laptop does. Baseline: offline decoding of the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from decode import decode_rate

from prefixserve import LLM

ENGINE_ARGS = ["--gguf-dequantize", "--num-kv-blocks", "512"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--model", model, *ENGINE_ARGS,
           "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


async def http_decode_rate(
    url: str, model: str, streams: int, max_tokens: int, vocab: int
) -> float:
    """Tokens/s generated after every stream's first token (one chunk per token, greedy)."""
    times: list[list[float]] = [[] for _ in range(streams)]

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": [(300 + 40 * i + j) % vocab for j in range(32)],
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times[i].append(time.perf_counter())

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(streams)))
    start = max(t[0] for t in times)  # every stream decodes from here on
    tokens = sum(sum(1 for x in t if x > start) for t in times)
    return tokens / (max(t[-1] for t in times) - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--server-threads", type=int, default=None, help="OMP_NUM_THREADS of the server"
    )
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args(argv)
    proc, url = start_server(args.model, args.server_threads)
    try:
        served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        llm = LLM(args.model, gguf_dequantize=True, num_kv_blocks=512)
        vocab = llm.llm_engine.runner.model_config.vocab_size
        asyncio.run(http_decode_rate(url, served, 1, 4, vocab))  # warm-up
        decode_rate(llm, 1, 4)
        rates: dict[str, dict[int, list[float]]] = {"http": {}, "offline": {}}
        for _ in range(args.runs):
            for n in args.streams:
                rates["http"].setdefault(n, []).append(
                    asyncio.run(http_decode_rate(url, served, n, args.max_tokens, vocab))
                )
                rates["offline"].setdefault(n, []).append(decode_rate(llm, n, args.max_tokens)[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    median = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in rates.items()}
    for n in args.streams:
        h, o = median["http"][n], median["offline"][n]
        print(
            f"{n:3d} streams: HTTP {h:6.1f} tok/s, offline {o:6.1f} tok/s, HTTP/offline {h / o:.2f}"
        )
    result = {
        "model": args.model,
        "torch_threads_offline": torch.get_num_threads(),
        "server_threads": args.server_threads,
        "max_tokens": args.max_tokens,
        "decode_tokens_per_s": rates,
        "median": median,
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_http.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
