"""Command line: ``prefixserve serve`` runs the OpenAI-compatible server; ``prefixserve demo`` runs a
short offline demo of prefix sharing."""

from __future__ import annotations

import argparse
import logging
import os
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=None, help="HF folder or hub id (default: built-in tiny-random)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--scheduling-policy", choices=["fcfs", "prefix"], default="fcfs")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )


def run_demo(args: argparse.Namespace) -> int:
    from prefixserve import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model"), **kwargs)
    system = "You are a careful assistant. Answer briefly and cite the documents you use. " * 12
    questions = [
        f"Question {i}: what does document {i % 3} say about prefix caching?" for i in range(8)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(f"model: {llm.llm_engine.model_name} (random weights: the text is meaningless)")
    for turn, batch in enumerate((questions[:1], questions[1:])):
        start = time.perf_counter()
        outs = llm.generate([system + q for q in batch], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cached = sum(o.num_cached_tokens for o in outs)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        print(
            f"batch {turn}: {len(outs)} requests, {cached}/{prompt} prompt tokens from the prefix "
            f"cache, {elapsed:.2f}s; first output: {outs[0].outputs[0].text[:40]!r}"
        )
    stats = llm.cache_stats()
    print(f"prefix-cache hit rate: {stats['hit_rate']:.1%}; blocks: {stats}")
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use in 'model' (default: the model's name)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("PREFIXSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $PREFIXSERVE_API_KEY)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes"],
        default=None,
        help="parse <tool_call> output into message.tool_calls",
    )


def run_serve(args: argparse.Namespace) -> int:
    from prefixserve.api.server import ServerConfig, run_server

    config = ServerConfig(
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        tool_call_parser=args.tool_call_parser,
    )
    return run_server(engine_kwargs(args), args.host, args.port, config, args.log_level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline demo of prefix sharing on the built-in model")
    _add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=16)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_engine_args(serve)
    _add_serve_args(serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        return run_demo(args)
    parser.error(f"unknown command {args.command}")
    return 2
