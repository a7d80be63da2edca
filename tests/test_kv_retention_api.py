"""Retention that agents control, over HTTP (in process, a live engine thread): Anthropic
``cache_control``, OpenAI ``prompt_cache_retention``, a reply that ends in a tool call, and
releasing (``DELETE /v1/responses/{id}``, ``POST /v1/kv/release``)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aio import run
from servers import MODEL
from test_reliability import inprocess, wait_idle
from tool_schemas import ADD, weather_and_add_tools

from prefixserve.api.server import ServerConfig

BLOCK = 16
SYSTEM = "You are a careful agent. Follow the house rules exactly. " * 6
ENGINE = {"max_model_len": 1024, "num_kv_blocks": 256, "block_size": BLOCK}


async def retained(engine, want: int | None = None, timeout: float = 10.0) -> dict:
    """The engine's cache stats once it is idle and ``retained_blocks`` == ``want`` (> 0 when
    None): retention after a reply is applied off the reply's path, a moment later."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await wait_idle(engine)
        count = stats["retained_blocks"]
        if count == want or (want is None and count > 0):
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.05)


def messages_body(**fields) -> dict:
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    return {"model": MODEL, "max_tokens": 4, "system": system,
            "messages": [{"role": "user", "content": "hello there"}], **fields}  # fmt: skip


@run
async def test_cache_control_retains_the_marked_prefix_and_splits_usage():
    async with inprocess(**ENGINE) as (client, engine):
        first = (await client.post("/v1/messages", json=messages_body())).json()["usage"]
        count = await client.post("/v1/messages/count_tokens", json=messages_body())
        num_prompt = count.json()["input_tokens"]
        assert first["cache_read_input_tokens"] == 0
        hour = first["cache_creation"]["ephemeral_1h_input_tokens"]
        assert hour > 0 and hour % BLOCK == 0 and first["cache_creation_input_tokens"] == hour
        assert first["input_tokens"] + hour == num_prompt  # the rest, after the system prompt
        stats = await retained(engine, hour // BLOCK)
        assert stats["retention_refused"] == 0

        second = (await client.post("/v1/messages", json=messages_body())).json()["usage"]
        assert second["cache_read_input_tokens"] >= hour
        assert second["cache_creation_input_tokens"] == 0
        assert second["input_tokens"] + second["cache_read_input_tokens"] == num_prompt

        # another cache_salt is another tenant's namespace: it releases nothing of ours
        other = await client.post("/v1/kv/release", json={"cache_salt": "other"})
        assert other.json()["released_blocks"] == 0
        mine = await client.post("/v1/kv/release", json={})
        assert mine.json() == {"object": "kv.release", "released_blocks": hour // BLOCK}
        await retained(engine, 0)


@run
async def test_streamed_usage_carries_the_same_split():
    async with inprocess(**ENGINE) as (client, _):
        whole = (await client.post("/v1/messages", json=messages_body())).json()["usage"]
        fresh = messages_body(stream=True, cache_salt="another namespace")
        async with client.stream("POST", "/v1/messages", json=fresh) as r:
            text = "".join([chunk async for chunk in r.aiter_text()])
        hour = whole["cache_creation"]["ephemeral_1h_input_tokens"]
        assert f'"ephemeral_1h_input_tokens": {hour}' in text


@pytest.mark.parametrize("mark", [{"type": "ephemeral", "ttl": "10m"}, {"type": "persistent"}])
@run
async def test_a_bad_cache_control_is_an_anthropic_400(mark):
    async with inprocess(**ENGINE) as (client, _):
        body = messages_body()
        body["system"][0]["cache_control"] = mark
        r = await client.post("/v1/messages", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "cache_control" in r.json()["error"]["message"]


@run
async def test_prompt_cache_retention_24h_retains_until_the_response_is_deleted():
    async with inprocess(**ENGINE) as (client, engine):
        body = {"model": MODEL, "input": SYSTEM + "question", "max_output_tokens": 4,
                "prompt_cache_retention": "24h"}  # fmt: skip
        response = (await client.post("/v1/responses", json=body)).json()
        stats = await retained(engine)
        assert stats["retained_blocks"] >= (len(SYSTEM) // 8) // BLOCK > 0  # prompt + reply
        r = await client.delete(f"/v1/responses/{response['id']}")
        assert r.json()["deleted"] is True
        stats = await retained(engine, 0)
        assert stats["retention_released"] > 0

        bad = await client.post("/v1/responses", json={**body, "prompt_cache_retention": "1w"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_cache_retention"
        memory = await client.post("/v1/responses",
                                   json={**body, "prompt_cache_retention": "in_memory"})  # fmt: skip
        assert memory.status_code == 200
        await asyncio.sleep(0.2)
        assert (await wait_idle(engine))["retained_blocks"] == 0


@run
async def test_prompt_cache_retention_on_chat_is_released_by_id():
    async with inprocess(**ENGINE) as (client, engine):
        body = {"model": MODEL, "messages": [{"role": "user", "content": SYSTEM}],
                "max_tokens": 4, "prompt_cache_retention": "24h", "prompt_cache_key": "p1"}  # fmt: skip
        completion = (await client.post("/v1/chat/completions", json=body)).json()
        count = (await retained(engine))["retained_blocks"]
        assert count > 0
        r = await client.post("/v1/kv/release", json={"id": completion["id"]})
        assert r.json()["released_blocks"] == count
        beams = await client.post("/v1/chat/completions",
                                  json={**body, "use_beam_search": True, "n": 2})  # fmt: skip
        assert beams.status_code == 400
        assert beams.json()["error"]["param"] == "prompt_cache_retention"


TOOLS = weather_and_add_tools(ADD)
ASK = [{"role": "user", "content": SYSTEM + "What is 2 + 3?"}]


async def _call(client, **fields) -> dict:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 60, "temperature": 0, "parallel_tool_calls": False, **fields}  # fmt: skip
    return (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]


@run
async def test_a_reply_that_calls_a_tool_keeps_its_kv_until_the_result_comes_back():
    async with inprocess(**ENGINE) as (client, engine):
        message = await _call(client)
        (call,) = message["tool_calls"]
        await retained(engine)
        table = engine.engine.scheduler.kv.retention
        assert not table._gaps

        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "5"}]  # fmt: skip
        body = {
            "model": MODEL,
            "messages": history,
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 2,
        }
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        stats = await retained(engine, 0)  # resumed: the pause ended, its retention released
        assert stats["retention_released"] > 0
        assert len(table._gaps) == 1


@run
async def test_the_tool_call_retention_can_be_turned_off():
    config = ServerConfig(served_model_names=[MODEL], retain_tool_call_kv=False)
    async with inprocess(config, **ENGINE) as (client, engine):
        assert (await _call(client))["tool_calls"]
        await asyncio.sleep(0.2)
        assert (await wait_idle(engine))["retained_blocks"] == 0
