"""Multi-turn tool-calling agents: prefixserve against transformers, side by side, on the bench model.

    python benchmarks/multi_turn_agents.py [--quick] [--agents 16] [--turns 4] [--system-len 1024]
        [--task-len 32] [--output-len 32] [--tool-len 64] [--hf-batch-size 16]

Workload: A agents share one system prompt of S random tokens; agent a's first prompt is the system
prompt plus its own task (``--task-len`` tokens). Each turn generates O tokens (greedy, EOS
ignored); the agent's next prompt is its previous prompt + that reply + a tool result of
``--tool-len`` seeded random tokens, for T turns. An agent submits its next turn the moment its
previous reply is complete; all agents start at once.
Machine: this CPU, float32, ``--threads`` torch threads for every system, one process.
Systems: prefixserve, ``hf-no-reuse`` and ``hf-prefix-cache`` (the shared system prompt prefilled
once; each turn's history is recomputed), as in ``hf_baselines.py``; a static batch takes the next
queued turns, so a follow-up turn waits for the batch it joins.

The optimum prefix-cache hits include the previous turn's reply (our cache registers generated
blocks). Writes ``multi_turn_agents.json`` / ``.png`` under ``--out-dir``.
"""

from __future__ import annotations

import random

from bench_model import BenchRequest
from shared_prefix import parse_comparison_args, run_comparison, save_and_print
from workloads import random_tokens


def main(argv: list[str] | None = None) -> dict:
    args = parse_comparison_args(__doc__.split("\n\n")[0], argv, {
        "agents": (16, 4), "turns": (4, 2), "system_len": (1024, 128), "task_len": (32, 16),
        "output_len": (32, 8), "tool_len": (64, 16),
    })  # fmt: skip
    rng = random.Random(args.seed)
    system = random_tokens(rng, args.system_len)
    tasks = [random_tokens(rng, args.task_len) for _ in range(args.agents)]

    def make_requests() -> list[BenchRequest]:
        return [
            BenchRequest(f"a{a}-t0", system + tasks[a], args.output_len, group="system")
            for a in range(args.agents)
        ]

    def next_turn(done: BenchRequest) -> BenchRequest | None:
        agent, turn = (int(part[1:]) for part in done.request_id.split("-"))
        if turn + 1 >= args.turns:
            return None
        tool = random_tokens(random.Random(f"{args.seed}/{agent}/{turn}"), args.tool_len)
        return BenchRequest(
            f"a{agent}-t{turn + 1}", done.prompt + done.output + tool, args.output_len, "system"
        )

    workload = {
        "name": "multi_turn_agents",
        "description": f"A={args.agents} agents x T={args.turns} turns, system {args.system_len} "
        f"+ task {args.task_len}, each turn +{args.output_len} reply +{args.tool_len} tool tokens",
        "agents": args.agents,
        "turns": args.turns,
        "system_len": args.system_len,
        "task_len": args.task_len,
        "output_len": args.output_len,
        "tool_len": args.tool_len,
    }
    result = run_comparison(
        args, workload, make_requests, {"system": args.system_len}, follow_up=next_turn
    )
    return save_and_print(result, args, "multi_turn_agents")


if __name__ == "__main__":
    main()
