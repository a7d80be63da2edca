"""What every example starts with: its command line (``--base-url``, ``--api-key`` and its own
options) and an OpenAI client of the running ``prefixserve serve`` with the model it serves; and
the fleet the agent examples inspect (their instructions, question, one tool and final report).
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


AGENT_INSTRUCTIONS = "You are an operations agent. Inspect hosts with the tools, then report. " * 2
FLEET_QUESTION = {"role": "user", "content": "Which of web-0 .. web-9 is unhealthy?"}
# the final report's JSON schema; bounded strings, so a random-weight model's report ends too
FLEET_REPORT = {
    "type": "object",
    "properties": {
        "unhealthy": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "summary": {"type": "string", "maxLength": 40},
    },
    "required": ["unhealthy", "summary"],
}


def host_status_tool(max_host_len: int | None = None, *, responses: bool = False) -> dict:
    """The agents' one tool: ``host_status(host)``; ``max_host_len`` bounds the argument (a
    grammar-constrained call then ends even from a random-weight model). Chat completions' shape,
    or the Responses API's flat one (``responses=True``)."""
    host: dict = {"type": "string"}
    if max_host_len is not None:
        host["maxLength"] = max_host_len
    function = {
        "name": "host_status",
        "description": "CPU load, memory and error rate of one host.",
        "parameters": {"type": "object", "properties": {"host": host}, "required": ["host"]},
    }
    return (
        {"type": "function", **function}
        if responses
        else {"type": "function", "function": function}
    )
