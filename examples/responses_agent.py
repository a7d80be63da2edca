"""A tool-calling agent over the Responses API, continued with ``previous_response_id``.

Each turn forces a tool call (``tool_choice="required"``), "runs" it, and sends back only the
tool's result, naming the previous response: the server builds the prompt from that response's
own token ids (a token-exact continuation) plus the new item, so every turn reuses the whole
conversation from the prefix cache. The script prints each turn's cached share of its prompt, and
ends with a JSON report (``text.format``). Works with the built-in random-weight model.

    python examples/responses_agent.py --base-url http://127.0.0.1:8000/v1 --turns 4
"""

from __future__ import annotations

import json

import common as fleet

TOOLS = [fleet.host_status_tool(max_host_len=12, responses=True)]


def main() -> None:
    parser = fleet.example_parser(__doc__)
    parser.add_argument("--turns", type=int, default=4)
    args, client, model = fleet.connect(parser)
    common = dict(model=model, instructions=fleet.AGENT_INSTRUCTIONS, tools=TOOLS, temperature=1.0)
    response = client.responses.create(
        input=fleet.FLEET_QUESTION["content"], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=64, **common,
    )  # fmt: skip
    for turn in range(args.turns):
        call = next(item for item in response.output if item.type == "function_call")
        host = json.loads(call.arguments)["host"]
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens
        print(f"turn {turn}: prompt {usage.input_tokens} tokens, cached {cached} "
              f"({cached / usage.input_tokens:.0%}); called {call.name}(host={host!r})")  # fmt: skip
        result = {"host": host, "cpu": 0.9 if turn % 2 else 0.2, "errors": turn}
        last = turn == args.turns - 1
        response = client.responses.create(
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": json.dumps(result)}],
            tool_choice="none" if last else "required", parallel_tool_calls=False,
            max_output_tokens=160 if last else 64,
            text={"format": {"type": "json_schema", "name": "report", "schema": fleet.FLEET_REPORT}},
            **common,
        )  # fmt: skip
    usage = response.usage
    print(
        f"report: {response.output_text} "
        f"(prompt {usage.input_tokens} tokens, cached {usage.input_tokens_details.cached_tokens})"
    )


if __name__ == "__main__":
    main()
