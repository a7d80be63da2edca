"""The engine's command-line options and the ``EngineConfig`` keyword arguments they give.

Shared by ``prefixserve demo``/``serve`` (cli.py) and the scale-out launcher, which builds each
replica's engine from the same arguments; it imports neither, so neither imports the other.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from dataclasses import fields
from pathlib import Path

from prefixserve.core.config import (
    DEFAULT_KV_CACHE_DIR_GB,
    DEFAULT_SEGMENT_RECOMPUTE_RATIO,
    EngineConfig,
)

SECRET_ENV = "PREFIXSERVE_KV_TIER_SECRET"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options that become ``EngineConfig`` fields (``engine_kwargs``), and ``--log-level``."""
    p.add_argument(
        "--model",
        default=None,
        help="HF folder, hub id, .gguf file or smollm2 (default: built-in tiny-random)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--max-stop-strings",
        type=int,
        default=64,
        help="most stop strings (and stop_token_ids) one request may give; past it a 400",
    )
    p.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=1024,
        help="longest stop string one request may give; past it a 400",
    )
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
    p.add_argument(
        "--attention-backend", default="auto", choices=["auto", "cpu", "torch", "triton"]
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run decode steps eagerly: no CUDA graphs, no compiled CPU step (default: "
        "PREFIXSERVE_ENFORCE_EAGER=1 in the environment, else off)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens and logprobs are bit-identical alone or in any batch (CPU, "
        "float32): every step's attention token by token",
    )
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="Inductor's cache of compiled CPU decode steps (default ~/.cache/prefixserve/inductor)",
    )
    p.add_argument(
        "--quantization",
        choices=["int8", "int4", "int4_sym"],
        default=None,
        help="weight-only quantization of the linear layers, groups of 32: int8, int4 (a scale "
        "and a shift per group, as GGUF's Q4_1) or int4_sym (a scale only, as Q4_0)",
    )
    p.add_argument(
        "--activation-quantization",
        choices=["int8", "none"],
        default="int8",
        help="how CPU kernels multiply int8/int4 weights: int8 quantizes each activation row in "
        "blocks of 32 and sums in integers (default); none keeps activations in float32",
    )
    p.add_argument(
        "--gguf-dequantize",
        action="store_true",
        help="GGUF: load quantized tensors as float instead of keeping them int4/int8",
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
    _add_kv_tier_args(p)
    _add_segment_args(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_segment_args(p: argparse.ArgumentParser) -> None:
    """Segment reuse (docs/segment-reuse.md)."""
    p.add_argument(
        "--segment-reuse",
        action="store_true",
        help="past a prompt's cached prefix, reuse the K/V of documents and paragraphs computed "
        "in other prompts wherever they sit (approximate; a request may opt out)",
    )
    p.add_argument(
        "--segment-recompute-ratio",
        type=float,
        default=DEFAULT_SEGMENT_RECOMPUTE_RATIO,
        metavar="SHARE",
        help="share of each reused segment's tokens recomputed in its new context (1.0: exact)",
    )


def _add_kv_tier_args(p: argparse.ArgumentParser) -> None:
    """Tiers under the KV pool and retention (docs/kv-tiers.md)."""
    p.add_argument(
        "--kv-offloading-size",
        type=float,
        default=None,
        metavar="GiB",
        help="host-memory tier for blocks evicted from the KV pool (vLLM's flag; default: off)",
    )
    p.add_argument(
        "--kv-offloading-dtype",
        choices=["auto", "int8", "fp8"],
        default="auto",
        help="keep host-tier blocks compressed (int8/fp8: about 4x more blocks, lossy)",
    )
    p.add_argument(
        "--kv-cache-dir",
        default=None,
        metavar="PATH",
        help="disk tier: every computed block is written here and survives restarts",
    )
    p.add_argument(
        "--kv-cache-dir-size",
        type=float,
        default=DEFAULT_KV_CACHE_DIR_GB,
        metavar="GiB",
        help="disk tier size; least recently used blocks are deleted past it",
    )
    p.add_argument(
        "--kv-shared-url",
        default=None,
        metavar="redis://HOST:PORT",
        help="shared tier in a Valkey/Redis server: replicas read the blocks others computed",
    )
    secret = p.add_mutually_exclusive_group()
    secret.add_argument(
        "--kv-tier-secret",
        default=None,
        metavar="SECRET",
        help=f"key that authenticates disk and shared-tier blocks; replicas sharing a tier share "
        f"it (default: ${SECRET_ENV}, else --kv-tier-secret-file, else kept in --kv-cache-dir)",
    )
    secret.add_argument(
        "--kv-tier-secret-file",
        default=None,
        metavar="PATH",
        help="read --kv-tier-secret from this file (keeps it out of the process list)",
    )
    p.add_argument(
        "--kv-tier-tenant-share",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="share of each local tier's bytes one tenant's retained blocks keep priority in",
    )
    p.add_argument(
        "--kv-retention-budget",
        type=float,
        default=0.5,
        help="share of the KV pool that retained prefixes (cache_control TTLs) may protect; "
        "shared max-min fairly between tenants",
    )
    p.add_argument(
        "--kv-retention-max-sessions",
        type=int,
        default=1024,
        metavar="N",
        help="retained prefixes (sessions) each tenant keeps at most; its oldest end first",
    )
    p.add_argument(
        "--kv-retention-max-ttl",
        dest="kv_retention_max_ttl_s",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="cap on any retention's TTL",
    )
    p.add_argument(
        "--no-kv-retention-learn-ttl",
        dest="kv_retention_learn_ttl",
        action="store_false",
        help="a pause on a tool call keeps the default TTL instead of one learned from gaps",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig(**engine_kwargs(args))`` for arguments parsed with ``add_engine_args``: every
    option whose name (``dest``) is a field's gives it its value, but for ``model`` (``_model``),
    ``activation_quantization`` (``none``: None), ``kv_tier_secret`` (``_tier_secret``) and an
    unset ``enforce_eager`` (left to ``EngineConfig``)."""
    kwargs = {name: getattr(args, name) for name in _config_options()}
    if kwargs["enforce_eager"] is None:
        del kwargs["enforce_eager"]
    return dict(
        kwargs,
        model=_model(args),
        activation_quantization=None if args.activation_quantization == "none" else "int8",
        kv_tier_secret=_tier_secret(args),
    )


@functools.cache
def _config_options() -> frozenset[str]:
    """The ``dest`` of every ``add_engine_args`` option that names an ``EngineConfig`` field."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return frozenset(vars(parser.parse_args([]))) & {f.name for f in fields(EngineConfig)}


def _tier_secret(args: argparse.Namespace) -> str | None:
    """``--kv-tier-secret``, the file ``--kv-tier-secret-file`` names, or ``$SECRET_ENV``."""
    if args.kv_tier_secret_file is not None:
        try:
            return Path(args.kv_tier_secret_file).read_text().strip() or None
        except OSError as exc:
            raise SystemExit(f"prefixserve: --kv-tier-secret-file: {exc}") from None
    return args.kv_tier_secret or os.environ.get(SECRET_ENV) or None


def _model(args: argparse.Namespace) -> str | None:
    """``serve MODEL`` as ``vllm serve`` takes it, or ``--model`` (not both, unless equal)."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise SystemExit(f"prefixserve: give the model once, not {positional!r} and --model "
                         f"{args.model!r}")  # fmt: skip
    return positional if positional is not None else args.model
