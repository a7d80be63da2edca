"""Agents over three protocols: what each turn recomputes, its TTFT and the bytes it sends.

    prefixserve serve --port 8000 &
    python benchmarks/agent_protocols.py --base-url http://127.0.0.1:8000 [--agents 4]
        [--turns 6] [--quick]

Workload: N agents x T turns, all agents at once. An agent's first turn is shared instructions
plus its task; every turn the model must call a tool (``tool_choice`` "required", a string
argument of at most ``--arg-chars`` characters, temperature 0) and the agent answers with a
seeded tool result of ``--result-words`` words. Run four ways, each under its own ``cache_salt``
(no hits across ways):

    responses_chain  /v1/responses, ``previous_response_id`` and only the new item (HTTP)
    responses_ws     the same over one WebSocket per agent, after a ``generate: false`` warm-up,
                     ``store: false`` (Codex's WebSocket mode)
    responses_full   /v1/responses resending every item, ``store: false`` (Codex over HTTP)
    chat             /v1/chat/completions resending the whole history

Per turn: ``recomputed`` = input tokens - cached tokens, against ``new`` = input tokens - the
previous turn's input and output tokens (the optimum recomputes only those, plus the previous
output's last token, whose K/V was never computed); the cached share; TTFT (send to the first
output event); bytes sent.
The model and settings are the same; the outputs are the same at turn 0 and may differ after it
where the prompts' token ids differ (re-rendered text need not re-tokenize as generated).
Machine: whatever the server runs on; the client is this host. ``responses_full`` and ``chat``
are the re-rendering that vLLM, SGLang and Ollama do for every request.

Peer (``--llama-server``): llama.cpp's ``llama-server`` (``benchmarks/peers/build_llama_server.sh``)
started here on ``--peer-gguf`` (default: SmolLM2's shipped Q4_1 file, the same weights as
``prefixserve serve smollm2``, which keeps Q4_1 exactly), one slot per agent, ``--threads``
threads, runs the ``chat`` way as ``llama_chat``: the full history each turn, its own per-slot
prompt cache (``cached_tokens`` is its ``prompt_tokens_details.cached_tokens``). It applies to
chat completions only: it keeps no responses by id. A model whose chat template has no tools
(SmolLM2) makes llama-server ignore ``tool_choice`` "required" and answer in text; such turns are
counted and printed (``tool_call`` false in the rows).

Writes ``agent_protocols.json`` under ``--out-dir`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from bench_model import RESULTS_DIR
from report import write_json
from workloads import WORDS

WAYS = ("responses_chain", "responses_ws", "responses_full", "chat")
PEER_WAY = "llama_chat"  # the chat way against llama-server
INSTRUCTIONS = "You are an operations agent. Call the tool until the task is done. " * 4


def tool(arg_chars: int) -> dict:
    return {"type": "function", "name": "run", "description": "Run one step of the task.",
            "parameters": {"type": "object", "required": ["step"], "additionalProperties": False,
                           "properties": {"step": {"type": "string", "maxLength": arg_chars}}}}  # fmt: skip


class Agent:
    """One agent's conversation in one way, and one row per turn."""

    def __init__(self, args: argparse.Namespace, way: str, index: int, client: httpx.AsyncClient):
        self.args, self.way, self.index, self.client = args, way, index, client
        self.salt = f"{way}-{args.seed}"
        self.items: list[dict] = [{"role": "user", "content": f"Task {index}: inspect host {index}."}]
        self.messages: list[dict] = [{"role": "system", "content": INSTRUCTIONS},
                                     {"role": "user", "content": self.items[0]["content"]}]  # fmt: skip
        self.previous: str | None = None
        self.rows: list[dict] = []
        self.ws = None

    def result(self, turn: int) -> str:
        rng = random.Random(f"{self.args.seed}/{self.index}/{turn}")
        return " ".join(rng.choice(WORDS) for _ in range(self.args.result_words))

    def response_body(self, new_items: list[dict]) -> dict:
        full = self.way == "responses_full"
        body = {"model": self.args.model, "instructions": INSTRUCTIONS, "temperature": 0,
                "tools": [tool(self.args.arg_chars)], "tool_choice": "required",
                "parallel_tool_calls": False, "max_output_tokens": 96, "stream": True,
                "cache_salt": self.salt, "store": self.way == "responses_chain",
                "input": self.items if full else new_items}  # fmt: skip
        if self.previous is not None and not full:
            body["previous_response_id"] = self.previous
        return body

    async def run(self) -> None:
        new_items = list(self.items)
        for turn in range(self.args.turns):
            if self.way in ("chat", PEER_WAY):
                call = await self._chat_turn(turn)
            else:
                call = await self._responses_turn(turn, new_items)
            output = {"type": "function_call_output", "call_id": call["call_id"],
                      "output": self.result(turn)}  # fmt: skip
            new_items = [output]
            self.items += [call, output]

    async def _responses_turn(self, turn: int, new_items: list[dict]) -> dict:
        body = self.response_body(new_items)
        if self.way == "responses_ws":
            response, ttft, sent = await self._ws_turn(body)
        else:
            response, ttft, sent = await self._sse_turn(body)
        self.previous = response["id"]
        (call,) = [item for item in response["output"] if item["type"] == "function_call"]
        usage = response["usage"]
        self._row(turn, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                  usage["output_tokens"], ttft, sent)  # fmt: skip
        return {k: call[k] for k in ("type", "call_id", "name", "arguments")}

    async def _sse_turn(self, body: dict) -> tuple[dict, float, int]:
        data = json.dumps(body).encode()
        start, ttft, final = time.perf_counter(), None, None
        async with self.client.stream("POST", "/v1/responses", content=data,
                                      headers={"content-type": "application/json"}) as reply:
            await _check(reply)
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if ttft is None and event["type"] == "response.output_item.added":
                    ttft = time.perf_counter() - start
                if event["type"] in ("response.completed", "response.incomplete"):
                    final = event["response"]
                if event["type"] == "response.failed":
                    raise RuntimeError(event["response"]["error"])
        assert final is not None, "the stream ended without a response"
        return final, ttft or 0.0, len(data)

    async def _ws_turn(self, body: dict) -> tuple[dict, float, int]:
        from websockets.asyncio.client import connect

        if self.ws is None:
            url = str(self.client.base_url).replace("http://", "ws://") + "/v1/responses"
            self.ws = await connect(url)
            warm = {**body, "input": [], "generate": False}
            warm.pop("previous_response_id", None)
            response, _, _ = await self._ws_exchange(warm)
            self.previous = response["id"]
            body["previous_response_id"] = self.previous
        return await self._ws_exchange(body)

    async def _ws_exchange(self, body: dict) -> tuple[dict, float, int]:
        data = json.dumps({"type": "response.create", **body})
        start, ttft = time.perf_counter(), None
        await self.ws.send(data)
        while True:
            event = json.loads(await self.ws.recv())
            if ttft is None and event["type"] == "response.output_item.added":
                ttft = time.perf_counter() - start
            if event["type"] in ("response.completed", "response.incomplete"):
                return event["response"], ttft or 0.0, len(data.encode())
            if event["type"] == "error":
                raise RuntimeError(event)

    async def _chat_turn(self, turn: int) -> dict:
        body = {"model": self.args.model, "messages": self.messages, "temperature": 0,
                "tools": [{"type": "function", "function": {k: v for k, v in tool(
                    self.args.arg_chars).items() if k != "type"}}],
                "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 96,
                "stream": True, "stream_options": {"include_usage": True},
                "cache_salt": self.salt}  # fmt: skip
        data = json.dumps(body).encode()
        start, ttft, usage = time.perf_counter(), None, None
        call: dict = {"id": "", "name": "", "arguments": ""}
        async with self.client.stream("POST", "/v1/chat/completions", content=data,
                                      headers={"content-type": "application/json"}) as reply:
            await _check(reply)
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    for delta in choice["delta"].get("tool_calls") or []:
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        call["id"] = delta.get("id") or call["id"]
                        function = delta.get("function", {})
                        call["name"] += function.get("name") or ""
                        call["arguments"] += function.get("arguments") or ""
        self._row(turn, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                  usage["completion_tokens"], ttft or 0.0, len(data))  # fmt: skip
        self.rows[-1]["tool_call"] = bool(call["name"])
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]})  # fmt: skip
        self.messages.append({"role": "tool", "tool_call_id": call["id"],
                              "content": self.result(turn)})  # fmt: skip
        return {"type": "function_call", "call_id": call["id"], "name": call["name"],
                "arguments": call["arguments"]}  # fmt: skip

    def _row(self, turn: int, prompt: int, cached: int, output: int, ttft: float, sent: int):
        before = self.rows[-1] if self.rows else None
        new = prompt - (before["input_tokens"] + before["output_tokens"]) if before else prompt
        self.rows.append({"way": self.way, "agent": self.index, "turn": turn,
                          "input_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
                          "recomputed": prompt - cached, "new": new, "ttft_s": ttft,
                          "bytes_sent": sent})  # fmt: skip


async def _check(reply: httpx.Response) -> None:
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread()).decode()}")


async def run_way(args: argparse.Namespace, way: str, base_url: str | None = None) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url or args.base_url, timeout=600) as client:
        agents = [Agent(args, way, i, client) for i in range(args.agents)]
        try:
            await asyncio.gather(*(agent.run() for agent in agents))
        finally:
            for agent in agents:
                if agent.ws is not None:
                    await agent.ws.close()
    return [row for agent in agents for row in agent.rows]


def summarize(rows: list[dict]) -> list[dict]:
    """Per way and turn: means over agents (TTFT: median)."""
    out = []
    keys = sorted({(r["way"], r["turn"]) for r in rows}, key=lambda k: ((*WAYS, PEER_WAY).index(k[0]), k[1]))
    for way, turn in keys:
        mine = [r for r in rows if r["way"] == way and r["turn"] == turn]

        def mean(key: str, mine: list[dict] = mine) -> float:
            return statistics.fmean(r[key] for r in mine)

        out.append({"way": way, "turn": turn, "input": mean("input_tokens"),
                    "new": mean("new"), "recomputed": mean("recomputed"),
                    "cached_share": sum(r["cached_tokens"] for r in mine)
                    / sum(r["input_tokens"] for r in mine),
                    "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in mine),
                    "bytes_sent": mean("bytes_sent")})  # fmt: skip
    return out


def markdown(summary: list[dict]) -> str:
    lines = ["| way | turn | input | new | recomputed | cached | TTFT ms | bytes sent |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summary:
        lines.append(f"| {s['way']} | {s['turn']} | {s['input']:.0f} | {s['new']:.0f} | "
                     f"{s['recomputed']:.0f} | {s['cached_share']:.0%} | {s['ttft_ms']:.0f} | "
                     f"{s['bytes_sent']:.0f} |")  # fmt: skip
    return "\n".join(lines)


async def continuations(base_url: str) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=base_url) as client:
        text = (await client.get("/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("prefixserve_responses_continuations_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


def run_peer(args: argparse.Namespace) -> list[dict]:
    """The chat way against a llama-server started here (rows of way ``llama_chat``)."""
    from peers import llama_server as peer

    model = args.peer_gguf or peer.smollm2_gguf()
    port = peer.free_port()
    cmd = peer.llama_server_command(
        peer.require_binary("llama-server"), model, port, threads=args.threads,
        parallel=args.agents, ctx_per_slot=4096)  # fmt: skip
    with peer.running(cmd, port) as base:
        return asyncio.run(run_way(args, PEER_WAY, base))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--arg-chars", type=int, default=24)
    parser.add_argument("--result-words", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ways", nargs="*", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out-dir", default=str(RESULTS_DIR))
    parser.add_argument("--quick", action="store_true", help="2 agents x 3 turns")
    parser.add_argument("--llama-server", action="store_true", help="also run llama_chat")
    parser.add_argument("--peer-gguf", default=None, help="default: smollm2's Q4_1 file")
    parser.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    args = parser.parse_args(argv)
    if args.quick:
        args.agents, args.turns = 2, 3
    if args.model is None:
        args.model = httpx.get(f"{args.base_url}/v1/models").json()["data"][0]["id"]
    before = asyncio.run(continuations(args.base_url))
    rows: list[dict] = []
    for way in args.ways:
        rows += asyncio.run(run_way(args, way))
    after = asyncio.run(continuations(args.base_url))
    if args.llama_server:
        rows += run_peer(args)
    summary = summarize(rows)
    result = {
        "workload": {k: getattr(args, k) for k in ("agents", "turns", "arg_chars",
                                                   "result_words", "seed", "model")},
        "continuations": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        "summary": summary,
        "rows": rows,
    }  # fmt: skip
    write_json(result, Path(args.out_dir) / "agent_protocols.json")
    print(markdown(summary))
    missed = [r for r in rows if r.get("tool_call") is False]
    if missed:
        ways = sorted({r["way"] for r in missed})
        print(f"{len(missed)} chat turns ({', '.join(ways)}) returned text, not a tool call "
              "(tool_choice 'required' not honoured): their history holds an empty call")  # fmt: skip
    print(f"continuations: {result['continuations']}")
    return result


if __name__ == "__main__":
    main()
