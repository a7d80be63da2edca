"""RAG over a fixed set of documents: many questions, each sent after the same documents. The
documents' KV is computed once and shared; the script prints each request's cached tokens and the
server's prefix-cache hit rate read from /metrics.

    python examples/rag.py --base-url http://127.0.0.1:8000/v1 --questions 8
"""

from __future__ import annotations

import httpx
from common import connect, example_parser

DOCUMENTS = [
    f"Document {i}: prefixserve stores the KV cache in blocks of 16 tokens. A block is identified by "
    f"a hash of its tokens and of every block before it, so block {i} of a shared prefix is found "
    "again by any request that starts with the same text."
    for i in range(6)
]


def hit_rate(metrics_url: str) -> float:
    values = {}
    for line in httpx.get(metrics_url).text.splitlines():
        for name in (
            "prefixserve_prefix_cache_hits_total",
            "prefixserve_prefix_cache_queries_total",
        ):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    queries = values.get("prefixserve_prefix_cache_queries_total", 0.0)
    return values.get("prefixserve_prefix_cache_hits_total", 0.0) / queries if queries else 0.0


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    args, client, model = connect(parser)
    context = "\n\n".join(DOCUMENTS)
    for q in range(args.questions):
        messages = [
            {"role": "system", "content": "Answer from the documents only."},
            {"role": "user", "content": f"{context}\n\nQuestion {q}: what is block {q % 6} for?"},
        ]
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=args.max_tokens
        )
        usage = out.usage
        print(
            f"question {q}: prompt {usage.prompt_tokens} tokens, "
            f"cached {usage.prompt_tokens_details.cached_tokens}"
        )
    metrics_url = args.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    print(f"server prefix-cache hit rate: {hit_rate(metrics_url):.1%}")


if __name__ == "__main__":
    main()
