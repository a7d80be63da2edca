"""Structured outputs: what the constraint costs, what compiling costs, what jump-forward saves,
and how far the prefix cache reaches through forced tool calls (bench model, CPU).

    python benchmarks/structured.py [--quick] [--batch-sizes 32 64] [--steps 24]

Sections, each side by side in this one process:
1. Constraint overhead per decode step, batch B: prefixserve unconstrained vs constrained by a
   JSON schema (an object holding an array of at least 30 short strings, so no sequence can end
   inside the window), over ``--steps`` decode steps in which all B sequences run, with
   jump-forward off (so both append one token per sequence and step); beside it, transformers
   without and with xgrammar's own logits processor (the same grammar), measured the same way:
   the median of ``--steps`` steady-state decode steps (logits processing, sampling and a
   one-token forward over its KV cache), the prompt's prefill untimed on both sides. Target: at most 10% per step at batch 64 for prefixserve. With jump-forward on, steps
   carry the forced tokens too: that run is compared in generated tokens per second.
2. Compile cost of a typical request: five tools forced with ``tool_choice="required"``, first
   compile (a fresh compiler) and the cached one (a repeat, as every agent turn resends its tools).
3. Jump-forward on a tool-call workload: 16 forced calls among five tools, on and off; wall time,
   engine steps and generated tokens (every output parses in both).
4. Cache reach: a multi-turn agent whose every turn is a forced tool call; turn k+1's cached
   prompt share against the optimum (the previous turn's prompt plus its call, block-aligned).
   The forced parts of a call re-tokenize as generated; sampled argument text may not (the model
   can pick a split the tokenizer would not), and the hit then stops where the splits differ.
Machine: this CPU, float32, ``--threads`` torch threads; temperature 1, seeded.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
import transformers
from bench_model import (
    DEFAULT_MODEL_DIR,
    RESULTS_DIR,
    ensure_checkpoint,
    load_hf_model,
    machine,
    make_engine,
    set_threads,
)
from report import write_json
from workloads import parse_sizes, random_tokens

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.structured_outputs.manager import StructuredOutputManager
from prefixserve.structured_outputs.params import StructuredOutputsParams
from prefixserve.structured_outputs.tool_calls import parse_tool_calls, tool_call_params

TARGET_OVERHEAD_PCT = 10.0
LONG_JSON = {
    "type": "object",
    "properties": {
        "words": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 30}
    },
    "required": ["words"],
}


def _tool(name: str, properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}),
    _tool("search_docs", {"query": {"type": "string", "maxLength": 24},
                          "top_k": {"type": "integer", "minimum": 1, "maximum": 10}}),
    _tool("create_ticket", {"title": {"type": "string", "maxLength": 20},
                            "priority": {"enum": ["low", "medium", "high"]}}),
    _tool("send_email", {"to": {"type": "string", "maxLength": 16},
                         "subject": {"type": "string", "maxLength": 16}}),
    _tool("add", {"a": {"type": "integer"}, "b": {"type": "integer"}}),
]  # fmt: skip
FORCED = tool_call_params(TOOLS, None, parallel=False)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The conversation with TOOLS, as the server renders it (the template writes BOS)."""
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def sampling(seed: int, max_tokens: int, so: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          structured_outputs=so)  # fmt: skip


def decode_window(
    engine: LLMEngine, batch: int, steps: int, so: StructuredOutputsParams | None
) -> tuple[float, float]:
    """(median ms per step, tokens generated per step) over ``steps`` decode steps in which all
    ``batch`` sequences run."""
    rng = random.Random(0)
    for i in range(batch):
        engine.add_request(f"o{i}", random_tokens(rng, 32), sampling(i, 4 * steps + 64, so))
    while engine.stats().num_waiting or engine.stats().generation_tokens < batch:
        engine.step()
    times, start_tokens = [], engine.stats().generation_tokens
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        if len(outs) != batch or any(o.finished for o in outs):
            raise RuntimeError("a sequence ended inside the measured window")
    tokens = engine.stats().generation_tokens - start_tokens
    for i in range(batch):
        engine.abort_request(f"o{i}")
    return 1e3 * statistics.median(times), tokens / steps


def hf_ms_per_step(model, tokenizer_info, batch: int, steps: int, constrained: bool) -> float:
    """transformers, median ms per steady-state decode step of ``batch`` rows: the step's logits
    processing (xgrammar's processor when ``constrained``), sampling and the next one-token
    forward over the KV cache, the quantity ``decode_window`` times for prefixserve."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    from prefixserve.structured_outputs.json_grammar import json_schema_ebnf

    rng = random.Random(0)
    ids = torch.tensor([random_tokens(rng, 32) for _ in range(batch)])
    processor = None
    if constrained:
        compiled = xgr.GrammarCompiler(tokenizer_info).compile_grammar(
            json_schema_ebnf(json.dumps(LONG_JSON))
        )
        processor = LogitsProcessor(compiled)
    gen = torch.Generator().manual_seed(0)
    times = []
    cache = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(ids, cache=cache, use_cache=True)  # the prefill, untimed
        for _ in range(steps):
            t0 = time.perf_counter()
            scores = out.logits[:, -1, :].float()
            if processor is not None:
                scores = processor(ids, scores)
            token = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen)
            ids = torch.cat([ids, token], dim=1)
            out = model(token, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def overhead(folder: Path, batches: list[int], steps: int, rounds: int) -> list[dict]:
    """Per batch size, in ``rounds`` rounds run back to back (medians kept): the constraint's own
    cost per step (jump-forward off, one token per sequence and step either way), and tokens/s
    with jump-forward on; transformers with and without xgrammar's processor beside them, per
    steady-state decode step too."""
    hf = load_hf_model(folder)
    so = StructuredOutputsParams(json=LONG_JSON)
    rows = []
    for batch in batches:
        plain = make_engine(folder, max_num_seqs=batch, enable_jump_forward=False)
        jumping = make_engine(folder, max_num_seqs=batch)
        info = plain.structured_outputs.tokenizer_info
        decode_window(plain, batch, 4, None)  # warm-up
        runs: dict[str, list[tuple[float, float]]] = {}  # (ms per step, tokens per step)
        for _ in range(rounds):
            for name, engine, spec in (("free", plain, None), ("constrained", plain, so),
                                       ("constrained_jump", jumping, so)):  # fmt: skip
                runs.setdefault(name, []).append(decode_window(engine, batch, steps, spec))
            for name, constrained in (("hf_free", False), ("hf_constrained", True)):
                runs.setdefault(name, []).append(
                    (hf_ms_per_step(hf, info, batch, steps, constrained), float(batch))
                )
        ms = {name: statistics.median(r[0] for r in rs) for name, rs in runs.items()}
        tok_s = {name: statistics.median(1e3 * r[1] / r[0] for r in rs)
                 for name, rs in runs.items()}  # fmt: skip
        rows.append({
            "batch": batch,
            "ms_per_step": ms,
            "tokens_per_s": tok_s,
            "prefixserve_overhead_pct": 100 * (ms["constrained"] / ms["free"] - 1),
            "transformers_overhead_pct": 100 * (ms["hf_constrained"] / ms["hf_free"] - 1),
            "jump_forward_tokens_per_s_vs_free": tok_s["constrained_jump"] / tok_s["free"],
        })  # fmt: skip
    return rows


def compile_cost(engine: LLMEngine) -> dict:
    fresh = StructuredOutputManager(engine.tokenizer, engine.model_config.vocab_size)
    t0 = time.perf_counter()
    fresh.validate(FORCED)
    first = time.perf_counter() - t0
    repeats = []
    for _ in range(20):
        t0 = time.perf_counter()
        fresh.validate(FORCED)
        repeats.append(time.perf_counter() - t0)
    fresh.shutdown()
    return {"tools": len(TOOLS), "first_ms": 1e3 * first,
            "cached_ms": 1e3 * statistics.median(repeats)}  # fmt: skip


def forced_calls(engine: LLMEngine, num: int) -> tuple[dict, list[str]]:
    """``num`` forced calls (one prompt each); wall time, steps, tokens, and the texts."""
    tok = engine.tokenizer
    start_steps, start_tokens = engine.stats().num_steps, engine.stats().generation_tokens
    t0 = time.perf_counter()
    for i in range(num):
        messages = [{"role": "user", "content": f"Task {i}: do what the tools allow."}]
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=160, structured_outputs=FORCED)
        engine.add_request(f"f{i}", chat_ids(tok, messages), params)
    texts = {}
    while engine.has_unfinished_requests():
        texts.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    stats = engine.stats()
    return {
        "seconds": time.perf_counter() - t0,
        "steps": stats.num_steps - start_steps,
        "generated_tokens": stats.generation_tokens - start_tokens,
    }, list(texts.values())


def jump_forward(folder: Path, num: int) -> dict:
    result = {}
    for on in (True, False):
        engine = make_engine(folder, enable_jump_forward=on)
        figures, texts = forced_calls(engine, num)
        figures["all_parse"] = all(len(parse_tool_calls(t)[0]) == 1 for t in texts)
        result["on" if on else "off"] = figures
    result["speedup"] = result["off"]["seconds"] / result["on"]["seconds"]
    return result


def cache_reach(folder: Path, turns: int) -> list[dict]:
    engine = make_engine(folder)
    tok, bs = engine.tokenizer, engine.config.block_size
    messages = [{"role": "system", "content": "You are an operations agent. " * 40},
                {"role": "user", "content": "Inspect the hosts, one call a turn."}]  # fmt: skip
    rows, previous, previous_prompt = [], 0, 0
    for turn in range(turns):
        prompt = chat_ids(tok, messages)
        engine.add_request(f"t{turn}", prompt, SamplingParams(temperature=1.0, seed=turn,
                           max_tokens=160, structured_outputs=FORCED))  # fmt: skip
        out = None
        while engine.has_unfinished_requests():
            out = next((o for o in engine.step() if o.finished), out)
        optimum = min(previous, len(prompt) - 1) // bs * bs
        rows.append({"turn": turn, "prompt_tokens": len(prompt),
                     "previous_prompt_tokens": previous_prompt,
                     "cached_tokens": out.num_cached_tokens, "optimum": optimum})  # fmt: skip
        previous = len(prompt) + len(out.outputs[0].token_ids)
        previous_prompt = len(prompt)
        ((name, arguments),) = parse_tool_calls(out.outputs[0].text)[0]
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": name, "arguments": arguments}}  # fmt: skip
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 4, 4 steps, 4 calls, 3 turns")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--threads", type=int, default=2)
    args = parse_sizes(parser, argv, {
        "batch_sizes": ([32, 64], [4]), "steps": (24, 4), "calls": (16, 4), "turns": (6, 3),
        "rounds": (3, 1),
    })  # fmt: skip
    set_threads(args.threads)
    folder = ensure_checkpoint(args.model_dir)
    result = {
        "machine": machine(),
        "overhead": overhead(folder, args.batch_sizes, args.steps, args.rounds),
        "compile": compile_cost(make_engine(folder)),
        "jump_forward": jump_forward(folder, args.calls),
        "cache_reach": cache_reach(folder, args.turns),
        "target_overhead_pct": TARGET_OVERHEAD_PCT,
    }
    write_json(result, args.out_dir / "structured.json")
    for row in result["overhead"]:
        print(
            f"batch {row['batch']}: constrained step {row['prefixserve_overhead_pct']:+.1f}% "
            f"(prefixserve), {row['transformers_overhead_pct']:+.1f}% (transformers+xgrammar); "
            f"with jump-forward {row['jump_forward_tokens_per_s_vs_free']:.2f}x the free "
            "tokens/s"
        )
    c, j = result["compile"], result["jump_forward"]
    print(
        f"compile {c['tools']} tools: first {c['first_ms']:.1f} ms, cached {c['cached_ms']:.3f} ms"
    )
    print(f"jump-forward: {j['speedup']:.2f}x ({j['on']['steps']} vs {j['off']['steps']} steps)")
    reach = [r["cached_tokens"] / max(r["optimum"], 1) for r in result["cache_reach"][1:]]
    print(f"cache reach, turns 2+: {min(reach):.0%} .. {max(reach):.0%} of the optimum")
    return result


if __name__ == "__main__":
    main()
