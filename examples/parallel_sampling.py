"""Parallel sampling: n continuations of one prompt. The prompt is computed once; the n samples
fork from it and share its KV blocks (copy-on-write).

    python examples/parallel_sampling.py --base-url http://127.0.0.1:8000/v1 --n 4
"""

from __future__ import annotations

from common import connect, example_parser


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args, client, model = connect(parser)
    prompt = "Write a one-line slogan for a serving engine that shares prefixes: " * 4
    out = client.completions.create(
        model=model,
        prompt=prompt,
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=1.0,
        top_p=0.95,
        seed=0,
    )
    for choice in out.choices:
        print(f"sample {choice.index} [{choice.finish_reason}]: {choice.text!r}")
    print(
        f"prompt {out.usage.prompt_tokens} tokens computed once, "
        f"{out.usage.completion_tokens} tokens generated over {args.n} samples"
    )


if __name__ == "__main__":
    main()
