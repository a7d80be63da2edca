"""What the quality benchmarks share (quant_ppl.py, activation_quality.py): a text scored by
teacher forcing in one prompt, and their command line.

A text of ``n`` tokens gives ``n - 1`` scores, one per position after the first: the log p of the
text's own token given every token before it (``prompt_logprobs``) and the most likely token
there. Perplexity is ``exp(-mean log p)`` over them.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from workloads import RESULTS_DIR

from prefixserve import LLM, SamplingParams


def score(llm: LLM, ids: list[int]) -> tuple[list[float], list[int]]:
    """Per position after the first: (log p of the text's token, the most likely token)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([ids], params, use_tqdm=False)[0]
    logprobs = [lp[tok] for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    top = [max(lp, key=lp.get) for lp in out.prompt_logprobs[1:]]
    return logprobs, top


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def parse_args(doc: str, schemes: list[str], argv: list[str] | None) -> argparse.Namespace:
    """``--model``, ``--schemes`` (of ``schemes``, all by default), ``--threads`` (set as torch's
    CPU threads here) and ``--out-dir``, with ``doc`` as the help's description."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="a GGUF file or named model")
    parser.add_argument("--schemes", nargs="+", default=schemes, choices=schemes)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args
