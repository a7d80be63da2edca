"""Synthetic workloads shared by the benchmarks (pure functions, no engine): request-length
distributions, random prompts, the options and request lists of the KV-memory benchmarks, and
``parse_sizes`` (a benchmark's workload sizes, full and ``--quick``).

The two distributions stand in for the datasets of the PagedAttention paper (Kwon et al., SOSP
2023, Fig. 11), whose means they copy; their shapes (lognormal, the sigmas below) are our choice,
picked to give the long right tails of the paper's histograms:

    name      input mean  input sigma  output mean  output sigma  paper's dataset
    sharegpt  160         1.0          340          0.8           ShareGPT: 161 in, 338 out
    alpaca    20          0.6          60           0.8           Alpaca: 19.3 in, 58.5 out

ShareGPT has 8.4x longer inputs and 5.8x longer outputs than Alpaca in the paper; the means here
keep those ratios (8x, 5.7x). A batch is drawn stratified (Latin hypercube: one draw from each
equal-probability slice of the distribution), so that even a small batch has close to these means.
Samples are rounded, at least 1, and clipped so that input + output fits the model's context (4096
for the built-in model), which trims the ShareGPT means by under 1%.

    lengths = sample_lengths(SHAREGPT, num_requests=32, seed=0, max_model_len=4096)
    prompts = [random_prompt(rng, n_in, vocab_size=710) for n_in, _ in lengths]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
MAX_MODEL_LEN = 4096  # the built-in model's context
PROMPT_VOCAB = 710  # the built-in model's ids below its special tokens
TOKEN_RANGE = (10, 700)  # plain byte / merge tokens of the built-in tokenizer, no special tokens
# the vocabulary of random text prompts (``http_load.py --prompt-format text``)
WORDS = [
    "cache",
    "prefix",
    "block",
    "token",
    "agent",
    "tool",
    "query",
    "answer",
    "model",
    "server",
    "batch",
    "step",
]


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Lognormal input and output lengths, given by their means and log-space sigmas."""

    name: str
    input_mean: float
    input_sigma: float
    output_mean: float
    output_sigma: float

    def describe(self) -> str:
        return (
            f"{self.name}: lognormal input mean {self.input_mean:g} (sigma {self.input_sigma:g}), "
            f"output mean {self.output_mean:g} (sigma {self.output_sigma:g})"
        )


SHAREGPT = LengthDistribution("sharegpt", 160.0, 1.0, 340.0, 0.8)
ALPACA = LengthDistribution("alpaca", 20.0, 0.6, 60.0, 0.8)
DISTRIBUTIONS = {d.name: d for d in (SHAREGPT, ALPACA)}


def stratified_lognormal(rng: random.Random, num: int, mean: float, sigma: float) -> list[float]:
    """``num`` draws of a lognormal of mean ``mean``, one from each of ``num`` equal-probability
    strata (Latin hypercube sampling), in random order.

    Unbiased like i.i.d. draws, but a batch of 16 already has its mean within ~10% of ``mean``
    (one standard deviation), where 16 i.i.d. draws of the ShareGPT-like outputs vary by ~25%.
    """
    mu = math.log(mean) - sigma * sigma / 2
    normal = NormalDist()
    draws = [math.exp(mu + sigma * normal.inv_cdf((i + rng.random()) / num)) for i in range(num)]
    rng.shuffle(draws)
    return draws


def sample_lengths(
    dist: LengthDistribution, num_requests: int, seed: int, max_model_len: int
) -> list[tuple[int, int]]:
    """``num_requests`` (input_len, output_len) pairs, each >= 1, with input + output <= max_model_len.

    Inputs and outputs are drawn independently of each other, each stratified.
    """
    rng = random.Random(seed)
    inputs = stratified_lognormal(rng, num_requests, dist.input_mean, dist.input_sigma)
    outputs = stratified_lognormal(rng, num_requests, dist.output_mean, dist.output_sigma)
    pairs = []
    for x_in, x_out in zip(inputs, outputs):
        n_in = min(max(1, round(x_in)), max_model_len - 1)
        pairs.append((n_in, min(max(1, round(x_out)), max_model_len - n_in)))
    return pairs


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Uniform random token ids in ``[0, vocab_size)``: two prompts share no prefix block."""
    return [rng.randrange(vocab_size) for _ in range(length)]


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random ids in ``TOKEN_RANGE``: ordinary text tokens, never a special token."""
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def build_requests(
    dist: LengthDistribution, num_requests: int, seed: int, max_input: int, max_output: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request for the built-in model, lengths drawn from
    ``dist`` and capped at the given maxima."""
    rng = random.Random(seed)
    return [
        (random_prompt(rng, min(n_in, max_input), PROMPT_VOCAB), min(n_out, max_output))
        for n_in, n_out in sample_lengths(dist, num_requests, seed, MAX_MODEL_LEN)
    ]


def write_report(out_dir: Path, name: str, report: dict) -> Path:
    """Write ``report`` as ``out_dir/name.json`` (the one way every benchmark here writes one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def parse_run_options(
    parser: argparse.ArgumentParser, argv: list[str] | None, quick_help: str
) -> argparse.Namespace:
    """Parse ``argv`` with the options the KV-memory benchmarks share added after their own;
    ``quick_help`` says what ``--quick`` shrinks."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--quick", action="store_true", help=f"{quick_help} (CI smoke test)")
    return parser.parse_args(argv)


def parse_sizes(
    parser: argparse.ArgumentParser, argv: list[str] | None, sizes: dict[str, tuple[Any, Any]]
) -> argparse.Namespace:
    """Parse ``argv`` with an option ``--NAME`` added for every workload size ``NAME: (full,
    quick)`` (a number, or a list of them: one run each; of the full value's type). The parser
    has ``--quick``; with it every size takes its quick value, whatever was passed."""
    for name, (full, _) in sizes.items():
        many = isinstance(full, list)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(full[0] if many else full),
                            default=full, nargs="+" if many else None)  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        for name, (_, quick) in sizes.items():
            setattr(args, name, quick)
    return args
