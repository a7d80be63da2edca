"""The engine's command-line options and the ``EngineConfig`` keyword arguments they give.

Shared by ``prefixserve demo``/``serve`` (cli.py) and the scale-out launcher, which builds each
replica's engine from the same arguments; it imports neither, so neither imports the other.
"""

from __future__ import annotations

import argparse
import json


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
        choices=["int8", "int4"],
        default=None,
        help="weight-only quantization of the linear layers (int8 per channel, int4 group 32)",
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
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig(**engine_kwargs(args))`` for arguments parsed with ``add_engine_args``."""
    optional = {"enforce_eager": args.enforce_eager}
    return dict(
        {k: v for k, v in optional.items() if v is not None},
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
        compile_cache_dir=args.compile_cache_dir,
        batch_invariant=args.batch_invariant,
        quantization=args.quantization,
        gguf_dequantize=args.gguf_dequantize,
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
