"""Soak: a bounded run of simulated agents against a real ``prefixserve serve`` process.

Workload: ``--agents`` concurrent agents on the built-in model (random weights), each resending a
growing conversation (a shared system prompt, then its own turns and the server's answers) with
``--max-tokens`` per answer, restarting when the conversation nears the context limit. Machine:
whatever runs it (CPU by default). Baseline: the server's own state after ``--warmup`` seconds.

Sampled every ``--interval`` seconds: the server's RSS (/proc/PID/status VmRSS) and open file
descriptors (/proc/PID/fd). Checks at the end: RSS growth after warm-up within ``--max-rss-growth``,
fd count not above its post-warm-up level (plus a small slack for sockets in flight), no failed
request, and once idle every KV block free or merely cached (used_blocks 0 in /metrics).

    python benchmarks/soak.py --duration 120 --agents 32 --out benchmarks/results/soak.json

Prints one summary line and writes JSON; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

SYSTEM = "You are a tool-using agent. Plan, call tools, report results briefly. " * 3
FD_SLACK = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def blocks(samples: dict[str, float], state: str) -> float:
    return next(v for k, v in samples.items() if k.startswith("prefixserve_kv_blocks{")
                and f'state="{state}"' in k)  # fmt: skip


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--port", str(port), "--log-level",
           "warning", "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len",
           str(args.max_model_len)]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError("server did not become healthy")
        time.sleep(0.2)


async def agent(
    i: int, c: httpx.AsyncClient, stop_at: float, args: argparse.Namespace, stats: dict
) -> None:
    rng = random.Random(i)
    messages = [{"role": "system", "content": SYSTEM}]
    while time.monotonic() < stop_at:
        messages.append({"role": "user", "content": f"agent {i} step {rng.randrange(1000)}"})
        body = {"messages": messages, "max_tokens": args.max_tokens, "temperature": 0.7,
                "seed": rng.randrange(2**31), "stream": rng.random() < 0.5}  # fmt: skip
        try:
            if body["stream"]:
                text, ok = "", False
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            ok = r.status_code == 200
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            if "error" in event:
                                raise RuntimeError(event["error"]["message"])
                            for choice in event["choices"]:
                                text += choice["delta"].get("content") or ""
                if not ok:
                    raise RuntimeError(f"stream ended badly ({r.status_code})")
            else:
                r = await c.post("/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(r.text[:200])
                text = r.json()["choices"][0]["message"]["content"]
            stats["ok"] += 1
            messages.append({"role": "assistant", "content": text})
        except (httpx.HTTPError, RuntimeError) as exc:
            stats["failed"] += 1
            stats["errors"].append(repr(exc)[:200])
            messages = messages[:1]
            continue
        if len(messages) > args.turns:
            messages = messages[:1]  # a new conversation, same system prompt


async def drive(base: str, args: argparse.Namespace, pid: int) -> dict:
    stats = {"ok": 0, "failed": 0, "errors": []}
    samples = []
    start = time.monotonic()
    stop_at = start + args.duration

    async def sampler() -> None:
        while time.monotonic() < stop_at:
            samples.append({"t": round(time.monotonic() - start, 2), "rss": rss_bytes(pid),
                            "fds": num_fds(pid)})  # fmt: skip
            await asyncio.sleep(args.interval)

    limits = httpx.Limits(max_connections=args.agents + 4)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
        await asyncio.gather(
            sampler(), *(agent(i, c, stop_at, args, stats) for i in range(args.agents))
        )
    stats["samples"] = samples
    return stats


def wait_idle(base: str, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base)
        if blocks(samples, "used") == 0 or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None, help="seconds (default: 25%% of duration)")
    p.add_argument("--agents", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--turns", type=int, default=12, help="messages before a conversation restarts")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between RSS/fd samples")
    p.add_argument("--max-rss-growth", type=float, default=0.15)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = p.parse_args(argv)
    warmup = args.duration * 0.25 if args.warmup is None else args.warmup

    proc, base = start_server(args)
    try:
        stats = asyncio.run(drive(base, args, proc.pid))
        idle = wait_idle(base)
        final_fds = num_fds(proc.pid)
        final_rss = rss_bytes(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    after = [s for s in stats["samples"] if s["t"] >= warmup] or stats["samples"][-1:]
    base_rss, base_fds = after[0]["rss"], after[0]["fds"]
    rss_growth = (max(s["rss"] for s in after) - base_rss) / base_rss
    checks = {
        "no_failed_requests": stats["failed"] == 0,
        "rss_growth_within_bound": rss_growth <= args.max_rss_growth,
        "fds_do_not_grow": final_fds <= base_fds + FD_SLACK,
        "no_used_blocks_when_idle": blocks(idle, "used") == 0,
    }
    report = {
        "workload": {k: v for k, v in vars(args).items() if k != "out"} | {"warmup": warmup},
        "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
        "requests_ok": stats["ok"],
        "requests_failed": stats["failed"],
        "errors": stats["errors"][:10],
        "rss_after_warmup_mb": round(base_rss / 2**20, 1),
        "rss_final_mb": round(final_rss / 2**20, 1),
        "rss_growth": round(rss_growth, 4),
        "fds_after_warmup": base_fds,
        "fds_final": final_fds,
        "kv_blocks_when_idle": {s: blocks(idle, s) for s in ("free", "cached", "used")},
        "checks": checks,
        "passed": all(checks.values()),
        "samples": stats["samples"],
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    print(
        f"soak {'PASS' if report['passed'] else 'FAIL'}: {stats['ok']} ok / {stats['failed']} "
        f"failed in {args.duration:.0f}s with {args.agents} agents; RSS "
        f"{report['rss_after_warmup_mb']}->{report['rss_final_mb']} MB "
        f"(+{rss_growth:.1%}); fds {base_fds}->{final_fds}; used blocks when idle "
        f"{report['kv_blocks_when_idle']['used']:.0f}"
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
