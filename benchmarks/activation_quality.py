"""What int8 activations cost in quality: each weight scheme on float32 activations against the
same weights on activations quantized to int8 (``--activation-quantization``).

    .venv/bin/python benchmarks/activation_quality.py [--model smollm2] [--schemes int8 int4 gguf]
        [--threads 2]

Workload: ``data/quality_text.txt`` (plain English prose written for this benchmark; 2,169
SmolLM2 tokens), scored in one prompt with ``prompt_logprobs=1``: teacher forcing, every position
sees the text's own tokens before it. Per weight scheme (``int8`` / ``int4``: ``--gguf-dequantize
--quantization``; ``gguf``: the file's Q4_1 kept as int4 with its Q8_0 vocabulary) the reference
is the same weights on float32 activations (``--activation-quantization none``), and each
variant is reported as its perplexity over the text (exp of minus the mean log p of each token
after the first), the change against the reference's, and greedy agreement: the share of
positions whose most likely next token is the reference's.

Variants:
- ``int8 kernel``: the integer kernels as served (``kernels/cpu_qlinear.cpp``: blocks of 32, one
  float32 scale each), the vocabulary matrix (``lm_head``) included;
- ``blocks of B`` (16, 32, 64, 192, a whole row; 192 divides both of SmolLM2's widths, 576 and
  1536, where 128 would not): the reference's kernels on activations rounded
  to int8 in blocks of B in torch first (``RoundedInputs``), the grouping question; blocks of 32
  is the kernel's arithmetic up to summation order;
- ``blocks of 32, lm_head float``: as ``blocks of 32`` but the vocabulary matrix on float
  activations, the ``lm_head``'s share.

Machine: any CPU with the C++ kernels (``--threads`` torch threads); quality does not depend on
it, only the run time does. Results: ``benchmarks/results/activation_quality.json``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from text_scoring import parse_args, perplexity, score
from workloads import write_report

from prefixserve import LLM
from prefixserve.models.linear import Linear, LinearKernel, PackedInt4, PackedInt8
from prefixserve.models.loader import load_tokenizer

TEXT = Path(__file__).resolve().parent / "data" / "quality_text.txt"
SCHEMES = {
    "int8": {"gguf_dequantize": True, "quantization": "int8"},
    "int4": {"gguf_dequantize": True, "quantization": "int4"},
    "int4_sym": {"gguf_dequantize": True, "quantization": "int4_sym"},
    "gguf": {},
}
BLOCKS = (16, 32, 64, 192, None)  # None: one block per row
VOCAB = ("embed_tokens", "lm_head")


def round_blocks(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """``x`` with each row's blocks of ``block`` values (None: the whole row) quantized to int8
    as the kernels do (``d = max|x| / 127``, codes rounded half to even) and dequantized."""
    width = x.shape[-1] if block is None else block
    blocks = x.reshape(-1, x.shape[-1] // width, width)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))).clamp(-127, 127)
    return (codes * d).view(x.shape)


class RoundedInputs(LinearKernel):
    """``inner`` (a float-activation kernel) on inputs rounded by ``round_blocks``."""

    def __init__(self, inner: LinearKernel, block: int | None) -> None:
        super().__init__(inner.out_features, inner.in_features, inner.dtype)
        self.inner, self.block = inner, block

    def forward(self, x, bias):
        return self.inner(round_blocks(x, self.block), bias)

    def rows(self, index):
        return self.inner.rows(index)


def quantized_linears(llm: LLM, vocab: bool) -> list[Linear]:
    """The model's ``Linear``s on float-activation quantized kernels (the vocabulary matrix
    only if ``vocab``)."""
    model = llm.llm_engine.runner.model
    return [m for name, m in model.named_modules()
            if isinstance(m, Linear) and isinstance(m.kernel, (PackedInt8, PackedInt4))
            and (vocab or name.rpartition(".")[2] not in VOCAB)]  # fmt: skip


def rounded_score(llm: LLM, ids: list[int], block: int | None, vocab: bool):
    """``score`` with the quantized linears' inputs rounded in blocks of ``block``."""
    linears = quantized_linears(llm, vocab)
    kernels = [m.kernel for m in linears]
    for m in linears:
        m.kernel = RoundedInputs(m.kernel, block)
    try:
        return score(llm, ids)
    finally:
        for m, kernel in zip(linears, kernels):
            m.kernel = kernel


def summary(logprobs: list[float], top: list[int], ref: dict) -> dict:
    ppl = perplexity(logprobs)
    agree = sum(a == b for a, b in zip(top, ref["top"])) / len(top)
    return {"perplexity": ppl, "change": ppl / ref["perplexity"] - 1, "greedy_agreement": agree}


def run_scheme(model: str, scheme: str, ids: list[int]) -> dict:
    options = {"num_kv_blocks": 256, "max_model_len": 4096, "enable_prefix_caching": False,
               "enforce_eager": True, **SCHEMES[scheme]}  # fmt: skip
    reference = LLM(model, activation_quantization=None, **options)
    logprobs, top = score(reference, ids)
    ref = {"perplexity": perplexity(logprobs), "top": top}
    variants = {}
    for block in BLOCKS:
        name = f"blocks of {block}" if block else "a whole row"
        variants[name] = summary(*rounded_score(reference, ids, block, vocab=True), ref)
    variants["blocks of 32, lm_head float"] = summary(
        *rounded_score(reference, ids, 32, vocab=False), ref
    )
    del reference
    variants["int8 kernel"] = summary(*score(LLM(model, **options), ids), ref)
    return {"reference_perplexity": ref["perplexity"], "variants": variants}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__, list(SCHEMES), argv)
    ids = load_tokenizer(args.model)(TEXT.read_text(), add_special_tokens=False).input_ids
    result: dict = {"model": args.model, "text": TEXT.name, "tokens": len(ids), "schemes": {}}
    for scheme in args.schemes:
        result["schemes"][scheme] = row = run_scheme(args.model, scheme, ids)
        print(f"{scheme}: float32 activations, perplexity {row['reference_perplexity']:.3f} "
              f"over {len(ids) - 1} tokens")  # fmt: skip
        for name, v in row["variants"].items():
            print(f"  {name:30s} perplexity {v['perplexity']:.3f} ({v['change']:+.2%}), "
                  f"greedy agreement {v['greedy_agreement']:.1%}")  # fmt: skip
    write_report(args.out_dir, "activation_quality", result)
    return result


if __name__ == "__main__":
    main()
