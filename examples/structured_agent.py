"""A tool-calling agent with structured outputs against `prefixserve serve` (no parser needed).

Each turn forces a tool call (``tool_choice="required"``): the server constrains the output to the
chat template's own tool-call syntax with arguments that match the tool's schema, so every call
parses, even from the built-in random-weight model. The loop "runs" the tool, appends the result
and goes on; at the end it asks for a final report as JSON matching a schema
(``response_format``). Because the forced call is exactly what the template re-renders, each turn
reuses the previous one from the prefix cache: the script prints cached_tokens per turn.

    python examples/structured_agent.py --base-url http://127.0.0.1:8000/v1 --turns 4
"""

from __future__ import annotations

import json

from common import (
    AGENT_INSTRUCTIONS,
    FLEET_QUESTION,
    FLEET_REPORT,
    connect,
    example_parser,
    host_status_tool,
)

TOOLS = [host_status_tool(max_host_len=12)]


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--turns", type=int, default=4)
    args, client, model = connect(parser)
    messages = [{"role": "system", "content": AGENT_INSTRUCTIONS}, FLEET_QUESTION]
    for turn in range(args.turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=64, temperature=1.0, seed=turn,
        )  # fmt: skip
        call = reply.choices[0].message.tool_calls[0]
        host = json.loads(call.function.arguments)["host"]
        cached = reply.usage.prompt_tokens_details.cached_tokens
        print(f"turn {turn}: prompt {reply.usage.prompt_tokens} tokens, cached {cached}; "
              f"called {call.function.name}(host={host!r})")  # fmt: skip
        messages.append({"role": "assistant", "content": None, "tool_calls": [call.model_dump()]})
        result = {"host": host, "cpu": 0.9 if turn % 2 else 0.2, "errors": turn}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    final = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "report", "schema": FLEET_REPORT}},
    )  # fmt: skip
    report = json.loads(final.choices[0].message.content)
    print(f"report: {json.dumps(report, ensure_ascii=False)} "
          f"(cached {final.usage.prompt_tokens_details.cached_tokens})")  # fmt: skip


if __name__ == "__main__":
    main()
