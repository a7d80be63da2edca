"""RAG: a few shared document sets, many questions each; prefixserve against transformers.

    python benchmarks/rag.py [--quick] [--doc-sets 3] [--docs-per-set 4] [--doc-len 256]
        [--preamble-len 64] [--questions-per-set 24] [--question-len 48] [--output-len 48]

Workload: every prompt starts with one instruction preamble shared by all requests
(``--preamble-len`` tokens), then the documents of its set (``--docs-per-set`` documents of
``--doc-len`` seeded random tokens, in the set's order), then its question; each request generates
O tokens (greedy, EOS ignored). Questions of all sets arrive shuffled (seeded), all at once, so the
prefix is shared at two levels: the preamble by everyone, the documents within a set.
Machine: this CPU, float32, ``--threads`` torch threads for every system, one process.
Systems: prefixserve, ``hf-no-reuse`` and ``hf-prefix-cache`` (preamble + documents of a set
prefilled once per set), as in ``hf_baselines.py``.

Writes ``rag.json`` / ``rag.png`` under ``--out-dir``.
"""

from __future__ import annotations

import random

from bench_model import BenchRequest
from shared_prefix import parse_comparison_args, run_comparison, save_and_print
from workloads import random_tokens


def main(argv: list[str] | None = None) -> dict:
    args = parse_comparison_args(__doc__.split("\n\n")[0], argv, {
        "doc_sets": (3, 2), "docs_per_set": (4, 2), "doc_len": (256, 48), "preamble_len": (64, 16),
        "questions_per_set": (24, 4), "question_len": (48, 16), "output_len": (48, 8),
    })  # fmt: skip
    rng = random.Random(args.seed)
    preamble = random_tokens(rng, args.preamble_len)
    contexts = [
        preamble + [t for _ in range(args.docs_per_set) for t in random_tokens(rng, args.doc_len)]
        for _ in range(args.doc_sets)
    ]
    questions = [
        (s, random_tokens(rng, args.question_len))
        for s in range(args.doc_sets)
        for _ in range(args.questions_per_set)
    ]
    rng.shuffle(questions)

    def make_requests() -> list[BenchRequest]:
        return [
            BenchRequest(f"q{i}-set{s}", contexts[s] + q, args.output_len, group=f"set{s}")
            for i, (s, q) in enumerate(questions)
        ]

    context_len = len(contexts[0])
    workload = {
        "name": "rag",
        "description": f"{args.doc_sets} doc sets x {args.questions_per_set} questions, preamble "
        f"{args.preamble_len} + {args.docs_per_set}x{args.doc_len} doc tokens + question "
        f"{args.question_len}, {args.output_len} out, shuffled, all at once",
        "doc_sets": args.doc_sets,
        "docs_per_set": args.docs_per_set,
        "doc_len": args.doc_len,
        "preamble_len": args.preamble_len,
        "questions_per_set": args.questions_per_set,
        "question_len": args.question_len,
        "output_len": args.output_len,
    }
    prefix_len = {f"set{s}": context_len for s in range(args.doc_sets)}
    result = run_comparison(args, workload, make_requests, prefix_len)
    return save_and_print(result, args, "rag")


if __name__ == "__main__":
    main()
