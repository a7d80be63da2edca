"""What every example starts with: its command line (``--base-url``, ``--api-key`` and its own
options) and an OpenAI client of the running ``prefixserve serve`` with the model it serves.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def example_parser(doc: str) -> argparse.ArgumentParser:
    """A parser described by the example's first docstring line, with the server options."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    return parser


def connect(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, OpenAI, str]:
    """Parse the command line; returns it, a client of the server at ``--base-url`` and the id of
    the (first) model the server serves."""
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    return args, client, client.models.list().data[0].id
