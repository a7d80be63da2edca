"""Command line: ``prefixserve serve`` runs the OpenAI-compatible server; ``prefixserve demo`` runs a
short offline demo of prefix sharing.

Test-only fault injection: ``PREFIXSERVE_FAULT_INJECT=step_after:N`` (read here at startup, nowhere
else) makes the served engine's ``step`` raise after N successful steps, so that tests can watch
the server die cleanly (/health 503, exit code 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

FAULT_INJECT_ENV = "PREFIXSERVE_FAULT_INJECT"


class InjectedFault(RuntimeError):
    """Raised by a fault-injected ``step`` (``PREFIXSERVE_FAULT_INJECT``)."""


def fault_injector(spec: str):
    """The engine hook for ``step_after:N``: wraps ``engine.step`` to raise after N steps."""
    kind, _, value = spec.partition(":")
    if kind != "step_after" or not value.isdigit():
        raise SystemExit(f"{FAULT_INJECT_ENV}: expected 'step_after:N', got {spec!r}")
    limit = int(value)

    def hook(engine) -> None:
        step = engine.step
        calls = 0

        def failing_step():
            nonlocal calls
            calls += 1
            if calls > limit:
                raise InjectedFault(f"injected fault after {limit} steps ({FAULT_INJECT_ENV})")
            return step()

        engine.step = failing_step

    return hook


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
    p.add_argument(
        "--no-enable-jump-forward",
        dest="enable_jump_forward",
        action="store_false",
        help="structured outputs: sample the text a grammar forces token by token",
    )
    p.add_argument("--scheduling-policy", choices=["fcfs", "prefix"], default="fcfs")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run decode steps eagerly too",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish prefix-cache changes (vLLM's KV events, ZMQ PUB) here, e.g. tcp://*:5557",
    )
    p.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ replay socket")
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (default: off)',
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=_model(args),
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_jump_forward=args.enable_jump_forward,
        scheduling_policy=args.scheduling_policy,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        speculative_config=args.speculative_config,
    )


def _model(args: argparse.Namespace) -> str | None:
    """``serve MODEL`` as ``vllm serve`` takes it, or ``--model`` (not both, unless equal)."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise SystemExit(f"prefixserve: give the model once, not {positional!r} and --model "
                         f"{args.model!r}")  # fmt: skip
    return positional if positional is not None else args.model


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
    from prefixserve.api.server import (
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        DEFAULT_MAX_WAITING_REQUESTS,
        DEFAULT_SHUTDOWN_GRACE_SECONDS,
    )

    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests allowed to wait for the engine; past it new ones get 503 + Retry-After",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may run before it is aborted with 408 (default: no limit)",
    )
    p.add_argument(
        "--shutdown-grace-seconds",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_SECONDS,
        help="on SIGTERM, how long requests in flight may finish before they are aborted",
    )
    p.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        default="auto",
        help="message content as one string or as OpenAI parts (auto: what the template reads)",
    )
    p.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse requests without a cache_salt (one prefix-cache namespace per tenant)",
    )


def run_serve(args: argparse.Namespace) -> int:
    from prefixserve.api.server import ServerConfig, run_server

    config = ServerConfig(
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        tool_call_parser=args.tool_call_parser,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        require_cache_salt=args.require_cache_salt,
        chat_template_content_format=args.chat_template_content_format,
    )
    from prefixserve.scale_out.launcher import run_scale_out, wants_scale_out

    if wants_scale_out(args):
        return run_scale_out(args, config)
    fault = os.environ.get(FAULT_INJECT_ENV)
    hook = fault_injector(fault) if fault else None
    return run_server(
        engine_kwargs(args), args.host, args.port, config, args.log_level, engine_hook=hook
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``prefixserve`` argument parser (``demo`` and ``serve`` subcommands)."""
    parser = argparse.ArgumentParser(prog="prefixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline demo of prefix sharing on the built-in model")
    _add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=16)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    _add_engine_args(serve)
    _add_serve_args(serve)
    from prefixserve.scale_out.launcher import add_scale_out_args

    add_scale_out_args(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return run_serve(args)
    if args.command == "demo":
        return run_demo(args)
    parser.error(f"unknown command {args.command}")
    return 2
