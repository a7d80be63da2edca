"""Beam search through the OpenAI API: `use_beam_search` (an extra field) with beam width `n`.
Beams fork from the prompt and from each other, sharing KV blocks until they diverge.

    python examples/beam_search.py --base-url http://127.0.0.1:8000/v1 --beam-width 4
"""

from __future__ import annotations

from common import connect, example_parser


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--length-penalty", type=float, default=1.0)
    args, client, model = connect(parser)
    out = client.completions.create(
        model=model,
        prompt="The best way to reuse a long prompt is",
        n=args.beam_width,
        max_tokens=args.max_tokens,
        extra_body={"use_beam_search": True, "length_penalty": args.length_penalty},
    )
    for choice in out.choices:
        print(f"beam {choice.index} [{choice.finish_reason}]: {choice.text!r}")


if __name__ == "__main__":
    main()
