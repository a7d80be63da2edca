"""The three protocol fronts over HTTP on scripted model output (``scripted_engine``): each reads
the same reply the same way, streamed and not, and the bugs of issue 30 (one test each)."""

from __future__ import annotations

import json

import pytest
from scripted_engine import Reply, ScriptedEngine, scripted_client

from prefixserve.api.frontend.protocol import APIError

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]  # fmt: skip
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"], "strict": False,
                    "parameters": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
MESSAGES_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                  for t in TOOLS]  # fmt: skip
CALL_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
CALL_G = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
CUT_G = '\n<tool_call>\n{"name": "g", "argu'
USER = [{"role": "user", "content": "go"}]


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip


def chat(client, stream: bool, **body) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of one chat choice."""
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER,
                                                  "stream": stream, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    if not stream:
        choice = r.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"]["tool_calls"]]  # fmt: skip
        return choice["message"]["content"], calls, choice["finish_reason"]
    content, calls, finish = "", {}, None
    for chunk in sse_events(r):
        for choice in chunk.get("choices", []):
            delta = choice["delta"]
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls") or []:
                call = calls.setdefault(entry["index"], ["", ""])
                call[0] += entry["function"].get("name") or ""
                call[1] += entry["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content.strip() or None, [tuple(calls[i]) for i in sorted(calls)], finish


def responses(client, stream: bool, **body) -> list[tuple]:
    """The response's output items as (type, text or name, arguments)."""
    r = client.post("/v1/responses", json={"model": "m", "input": "go", "stream": stream, **body})
    assert r.status_code == 200, r.text
    body = r.json() if not stream else next(
        e["response"] for e in sse_events(r) if e["type"] == "response.completed")
    output = body["output"]
    return [(i["type"], i["content"][0]["text"]) if i["type"] == "message"
            else (i["type"], i["name"], i["arguments"]) for i in output]  # fmt: skip


def messages(client, stream: bool, **body) -> list[dict]:
    """The message's content blocks."""
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 64, "messages": USER,
                                          "stream": stream, **body})  # fmt: skip
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["content"]
    blocks: list[dict] = []
    for e in sse_events(r):
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta, block = e["delta"], blocks[e["index"]]
            if delta["type"] in ("text_delta", "thinking_delta"):
                key = delta["type"].removesuffix("_delta")
                block[key] += delta[key]
            elif delta["type"] == "input_json_delta":
                block["input"] = json.loads(delta["partial_json"])
    return blocks


@pytest.mark.parametrize("stream", [False, True])
def test_bug1_a_cut_off_second_call_keeps_the_first_in_chat_and_messages(stream):
    """Two hermes calls, the second cut by ``max_tokens``: the first is a call and the cut one
    text, streamed or not (non-streamed chat and Messages gave no call and all the tags)."""
    reply = CALL_F + CUT_G
    engine = ScriptedEngine(replies=[Reply(pieces(reply, 7), "length") for _ in range(2)])
    with scripted_client(engine, tool_call_parser="hermes") as client:
        content, calls, finish = chat(client, stream, tools=TOOLS)
        assert calls == [("f", '{"a": 1}')] and content == CUT_G.strip()
        assert finish == "length"
        blocks = messages(client, stream, tools=MESSAGES_TOOLS)
        assert [b["type"] for b in blocks] == ["tool_use", "text"]
        assert blocks[0]["input"] == {"a": 1} and blocks[1]["text"].strip() == CUT_G.strip()


@pytest.mark.parametrize("stream", [False, True])
def test_bug2_responses_keep_one_call_without_parallel_tool_calls(stream):
    engine = ScriptedEngine(replies=[pieces(CALL_F + "\n" + CALL_G, 9)])
    with scripted_client(engine, tool_call_parser="hermes") as client:
        items = responses(client, stream, tools=RESPONSES_TOOLS, parallel_tool_calls=False)
    assert items == [("function_call", "f", '{"a": 1}')]


@pytest.mark.parametrize("stream", [False, True])
def test_every_protocol_reads_the_same_reply_the_same_way(stream):
    reply = "Sure.\n" + CALL_F + "\n" + CALL_G
    engine = ScriptedEngine(replies=[pieces(reply, 5) for _ in range(3)])
    with scripted_client(engine, tool_call_parser="hermes") as client:
        content, calls, finish = chat(client, stream, tools=TOOLS)
        assert (content, calls, finish) == ("Sure.", [("f", '{"a": 1}'), ("g", "{}")],
                                            "tool_calls")  # fmt: skip
        assert responses(client, stream, tools=RESPONSES_TOOLS) == [
            ("message", "Sure.\n"), ("function_call", "f", '{"a": 1}'),
            ("function_call", "g", "{}")]  # fmt: skip
        blocks = messages(client, stream, tools=MESSAGES_TOOLS)
        assert [(b["type"], b.get("text", b.get("input"))) for b in blocks] == [
            ("text", "Sure.\n"), ("tool_use", {"a": 1}), ("tool_use", {})]  # fmt: skip
    # each protocol's reply ended in a call: each named its provisional pause after its first call
    pauses = [[r.session for r in params.kv_retention if r.ttl_s is None]
              for _, params in engine.requests]  # fmt: skip
    assert len(pauses) == 3 and all(len(p) == 1 and p[0].startswith("/~") for p in pauses)
    assert [old for old, _ in engine.renamed] == [p[0] for p in pauses]
    assert all(name.startswith("/call_") for _, name in engine.renamed)
    assert engine.released == []


def test_bug3_reasoning_items_with_string_content_and_at_the_end():
    """A ``reasoning`` item whose ``content`` or ``summary`` is a string was a TypeError (an
    unshaped 500); one at the end of the input was dropped. It is the start of the reply: a
    continuation of a reply cut off inside its reasoning is token-exact."""
    engine = ScriptedEngine(replies=[Reply(["<think>\nfirst, ", "f?"], "length"), ["ok"], ["ok"]])
    with scripted_client(engine, reasoning_parser="qwen3") as client:
        r = client.post("/v1/responses", json={"model": "m", "input": "go"}).json()
        assert r["status"] == "incomplete" and r["output"][0]["type"] == "reasoning"
        cont = client.post("/v1/responses", json={"model": "m", "input": [],
                                                   "previous_response_id": r["id"]})  # fmt: skip
        assert cont.status_code == 200, cont.text
        assert client.app.state.responses.continuations["token_exact"] == 1
        prompt = engine.tokenizer.decode(engine.requests[1][0])
        assert prompt.endswith("<|im_start|>assistant\n<think>\nfirst, f?")
        items = [{"role": "user", "content": "go"},
                 {"type": "reasoning", "summary": "plan", "content": "details"}]  # fmt: skip
        r = client.post("/v1/responses", json={"model": "m", "input": items})
        assert r.status_code == 200, r.text
        prompt = engine.tokenizer.decode(engine.requests[2][0])
        assert prompt.endswith("assistant\n<think>details\nplan</think>\n\n")
        bad = client.post("/v1/responses", json={"model": "m", "input": [
            {"type": "reasoning", "summary": 3}]})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


@pytest.mark.parametrize("stream", [False, True])
def test_bug4_messages_enforce_the_thinking_budget(stream):
    """``thinking.budget_tokens`` was validated and then ignored: reasoning still open after the
    budget is closed there and the answer is generated after it, within ``max_tokens``."""
    thoughts = "<think>\n" + "".join(f"step {i}. " for i in range(600))
    engine = ScriptedEngine(replies=[pieces(thoughts, 200), ["The answer."]])
    with scripted_client(engine, reasoning_parser="qwen3") as client:
        blocks = messages(client, stream, max_tokens=3000,
                          thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    tok = engine.tokenizer
    (prompt, _), (answer_prompt, params) = engine.requests
    kept = answer_prompt[len(prompt) :]
    first_ids = tok.encode(thoughts, add_special_tokens=False)
    closing = tok.encode("\n</think>\n\n", add_special_tokens=False)
    assert kept == first_ids[:1024] + closing and len(engine.aborted) >= 1
    assert params.max_tokens == 3000 - len(kept)
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert blocks[0]["thinking"] == tok.decode(first_ids[:1024])[len("<think>"):] + "\n"
    assert blocks[1]["text"] == "The answer."


def test_bug5_refused_requests_count_no_continuation_or_truncation():
    engine = ScriptedEngine(replies=[["first answer"]], max_model_len=64)
    with scripted_client(engine) as client:
        first = client.post("/v1/responses", json={"model": "m", "input": "go"}).json()
        serving = client.app.state.responses
        engine.overloaded = True
        for extra in ({}, {"truncation": "auto", "input": "x " * 40}):
            r = client.post("/v1/responses", json={"model": "m", "input": "more",
                            "previous_response_id": first["id"], **extra})  # fmt: skip
            assert r.status_code == 503, r.text
        assert serving.continuations == {"token_exact": 0, "rerendered": 0, "truncated": 0}
        assert serving.truncations == 0
        engine.overloaded = False
        r = client.post("/v1/responses", json={"model": "m", "input": "more",
                                               "previous_response_id": first["id"]})  # fmt: skip
        assert r.status_code == 200 and serving.continuations["token_exact"] == 1


def test_prompt_cache_key_travels_as_the_tenants_routing_key():
    engine = ScriptedEngine()
    with scripted_client(engine) as client:
        msgs = [{"role": "user", "content": "hi"}]
        for body in ({}, {"prompt_cache_key": "p"}, {"prompt_cache_key": "p", "cache_salt": "s"}):
            client.post("/v1/chat/completions", json={"model": "m", "messages": msgs, **body})
            client.post("/v1/responses", json={"model": "m", "input": "hi", **body})
    none, none_r, key, key_r, salted, salted_r = engine.routing_keys
    assert none is None and none_r is None
    assert key == key_r and len(key) == 32  # a digest of the namespace and the key
    assert salted == salted_r and len(salted) == 32 and salted != key  # another namespace
    client_key = "k" * (1 << 20)  # a 1 MiB key reaches the router as the same 32 digits
    with scripted_client(engine) as client:
        client.post("/v1/chat/completions", json={"model": "m", "messages": msgs,
                                                  "prompt_cache_key": client_key})  # fmt: skip
    assert len(engine.routing_keys[-1]) == 32


def test_deleting_a_response_where_the_engine_cannot_release_still_deletes():
    class NoRelease(ScriptedEngine):  # the scale-out ingress: release is a 501
        async def release_kv(self, session: str) -> int:
            raise APIError("not available with --replicas", 501)

    with scripted_client(NoRelease()) as client:
        r = client.post("/v1/responses", json={"model": "m", "input": "hi"}).json()
        deleted = client.delete(f"/v1/responses/{r['id']}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert client.get(f"/v1/responses/{r['id']}").status_code == 404
