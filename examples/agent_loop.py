"""An agent loop against `prefixserve serve --tool-call-parser hermes`: a long shared system prompt
and a tool-call history that grows every turn. Each turn resends everything before it, so
prefixserve serves the old turns from its prefix cache; the script prints cached_tokens per turn.

The built-in model has random weights and never calls a tool by itself, so when it does not, the
loop records the call an agent would have made (the shape of the history is what matters here).

    python examples/agent_loop.py --base-url http://127.0.0.1:8000/v1 --turns 6
"""

from __future__ import annotations

import json

from common import FLEET_QUESTION, connect, example_parser, host_status_tool

SYSTEM = (
    "You are an operations agent for a fleet of web servers. Use the tools to inspect hosts "
    "before answering, never guess, and keep answers short. " * 3
)
TOOLS = [host_status_tool()]


def main() -> None:
    parser = example_parser(__doc__)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    args, client, model = connect(parser)
    messages = [{"role": "system", "content": SYSTEM}, FLEET_QUESTION]
    for turn in range(args.turns):
        out = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=args.max_tokens, temperature=0
        )
        usage, msg = out.usage, out.choices[0].message
        cached = usage.prompt_tokens_details.cached_tokens
        print(
            f"turn {turn}: prompt {usage.prompt_tokens} tokens, cached {cached} "
            f"({cached / usage.prompt_tokens:.0%}), finish_reason {out.choices[0].finish_reason}"
        )
        calls = [c.model_dump() for c in msg.tool_calls or []] or [
            {
                "id": f"call_{turn}",
                "type": "function",
                "function": {
                    "name": "host_status",
                    "arguments": json.dumps({"host": f"web-{turn}"}),
                },
            }
        ]
        messages.append({"role": "assistant", "content": msg.content or "", "tool_calls": calls})
        for call in calls:
            host = json.loads(call["function"]["arguments"]).get("host", "?")
            result = {"host": host, "cpu": 0.3 + 0.05 * turn, "errors_per_min": turn % 3}
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)}
            )


if __name__ == "__main__":
    main()
