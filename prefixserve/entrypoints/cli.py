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

from prefixserve.entrypoints.engine_args import add_engine_args, engine_kwargs

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


def _forced_tool_call(text: str) -> dict:
    """``--messages-force-tool-call``: a JSON object with a string "name" and an object
    "input_schema"."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not (
        isinstance(spec, dict)
        and isinstance(spec.get("name"), str)
        and isinstance(spec.get("input_schema"), dict)
    ):
        raise argparse.ArgumentTypeError('give {"name": TOOL, "input_schema": {...}}')
    return spec


def run_demo(args: argparse.Namespace) -> int:
    from prefixserve import LLM, SamplingParams
    from prefixserve.models import BUILTIN_MODEL_NAME

    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model"), **kwargs)
    system = "You are a careful assistant. Answer in one sentence. " + "Be precise and brief. " * 12
    questions = [
        "What is the capital of France?",
        "Why is the sky blue?",
        "What is a prime number?",
        "Name a planet of the solar system.",
        "What does a compiler do?",
        "What is 12 times 12?",
        "What is photosynthesis?",
        "Who wrote Hamlet?",
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    name = llm.llm_engine.model_name
    random = name == BUILTIN_MODEL_NAME
    print(f"model: {name}" + (" (random weights: the text is meaningless)" if random else ""))
    for turn, batch in enumerate((questions[:1], questions[1:])):
        chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                 for q in batch]  # fmt: skip
        start = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cached = sum(o.num_cached_tokens for o in outs)
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        print(
            f"batch {turn}: {len(outs)} requests, {cached}/{prompt} prompt tokens from the prefix "
            f"cache, {elapsed:.2f}s"
        )
        for q, o in list(zip(batch, outs))[:3]:
            print(f"  Q: {q}\n  A: {o.outputs[0].text.strip()!r}")
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
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health "
        "and --public-route ones; repeat for several keys, each its own tenant (default: "
        "$PREFIXSERVE_API_KEY)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help='a JSON file {"KEY": "tenant name", ...}: keys with the same name are one tenant '
        "(docs/tenancy.md)",
    )
    p.add_argument(
        "--public-route",
        dest="public_routes",
        action="append",
        default=[],
        metavar="PATH",
        help="answer PATH without an API key (repeatable; e.g. /metrics for a scraper, /dashboard "
        "and /stats for the page; never a /v1 path)",
    )
    p.add_argument(
        "--share-prefix-cache-across-tenants",
        action="store_true",
        help="let tenants share cached KV blocks (stored responses are never shared)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"],
        default=None,
        help="the model family's tool-call syntax: parse it into message.tool_calls (auto) and "
        "generate forced calls in it",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="split <think>...</think> into reasoning_content; grammars apply after it",
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
        "--allow-client-chat-template",
        action="store_true",
        help="accept a request's own chat_template (/v1/chat/completions, /tokenize), rendered "
        "with bounded output and steps; for clients trusted to run template code (default: 400)",
    )
    p.add_argument(
        "--keep-attribution-header",
        dest="drop_attribution_header",
        action="store_false",
        help="show the model Claude Code's per-session 'x-anthropic-billing-header' system block "
        "(default: left out of /v1/messages prompts, so sessions share their prefix)",
    )
    p.add_argument(
        "--messages-force-tool-call",
        type=_forced_tool_call,
        default=None,
        metavar="JSON",
        help='testing aid: {"name": TOOL, "input_schema": {...}}; /v1/messages requests that '
        "list TOOL and end with the user's own turn get a forced call of it matching the schema",
    )
    p.add_argument(
        "--retain-tool-call-kv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a reply that ends in a tool call keeps its KV (prompt and reply) retained until "
        "the call's result arrives, for a TTL learned from the gaps seen so far (capped by "
        "--kv-retention-max-ttl)",
    )
    p.add_argument(
        "--require-cache-salt",
        action="store_true",
        help="refuse requests without a cache_salt (one prefix-cache namespace per tenant)",
    )
    from prefixserve.api.openai.responses.store import (
        DEFAULT_MAX_AGE_S,
        DEFAULT_MAX_BYTES,
        DEFAULT_MAX_ENTRIES,
    )

    p.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="stored /v1/responses kept for previous_response_id (least recently used go first)",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="bytes the Responses store may hold (bodies, items, text, token ids)",
    )
    p.add_argument(
        "--responses-store-max-age",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help="seconds a stored response lives",
    )
    p.add_argument(
        "--responses-store-tenant-max-entries",
        type=int,
        default=None,
        help="stored responses one tenant may hold (default: the store's bound)",
    )
    p.add_argument(
        "--responses-store-tenant-max-bytes",
        type=int,
        default=None,
        help="bytes one tenant's stored responses may hold (default: the store's bound)",
    )
    p.add_argument(
        "--hosted-tools",
        choices=["accept", "refuse"],
        default="accept",
        help="hosted Responses tools (web_search, file_search, ...): accept them and offer them "
        "to no model (said in a response header), or refuse the request with a 400",
    )
    p.add_argument(
        "--responses-store-path",
        default=default_store_path(),
        help="the SQLite file stored responses are kept in across restarts; ':memory:' keeps "
        "them in memory only (docs/responses-store.md)",
    )


def default_store_path() -> str:
    """``$XDG_STATE_HOME/prefixserve/responses.sqlite3`` (``~/.local/state`` without it)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(state, "prefixserve", "responses.sqlite3")


def api_keys(keys: list[str] | None, keys_file: str | None) -> dict[str, str]:
    """``--api-key`` (each its own tenant; $PREFIXSERVE_API_KEY without one) and
    ``--api-keys-file`` as {key: tenant name}."""
    from prefixserve.api.frontend.tenancy import key_tenants, read_keys_file

    env = os.environ.get("PREFIXSERVE_API_KEY")
    out = key_tenants(keys or ([env] if env else []))
    return {**out, **(read_keys_file(keys_file) if keys_file else {})}


def run_serve(args: argparse.Namespace) -> int:
    from prefixserve.api.server import ServerConfig, run_server

    config = ServerConfig(
        served_model_names=list(args.served_model_name or []),
        api_keys=api_keys(args.api_key, args.api_keys_file),
        share_prefix_cache_across_tenants=args.share_prefix_cache_across_tenants,
        public_routes=args.public_routes,
        allow_client_chat_template=args.allow_client_chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        max_waiting_requests=args.max_waiting_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        request_timeout=args.request_timeout,
        shutdown_grace_seconds=args.shutdown_grace_seconds,
        require_cache_salt=args.require_cache_salt,
        chat_template_content_format=args.chat_template_content_format,
        responses_store_max_entries=args.responses_store_max_entries,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_max_age_s=args.responses_store_max_age,
        responses_store_tenant_max_entries=args.responses_store_tenant_max_entries,
        responses_store_tenant_max_bytes=args.responses_store_tenant_max_bytes,
        responses_store_path=args.responses_store_path,
        hosted_tools=args.hosted_tools,
        retain_tool_call_kv=args.retain_tool_call_kv,
        drop_attribution_header=args.drop_attribution_header,
        messages_force_tool_call=args.messages_force_tool_call,
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
    demo = sub.add_parser("demo", help="offline demo of prefix sharing (default: built-in model)")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=24)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_engine_args(serve)
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
