"""The retention budget between tenants, over HTTP (in process, two API keys): one key's marked
requests cannot lock the other out, blocks the pool evicted leave the budget, usage reports only
what was granted, and identical "24h" requests keep one session (issue 34, items 7 and 8)."""

from __future__ import annotations

from aio import run
from servers import MODEL
from test_reliability import inprocess, wait_idle

from prefixserve.api.server import ServerConfig
from prefixserve.kv.retention import HEAP_SLACK

BLOCK = 16
KEYS = {"ka": "team-a", "kb": "team-b"}
A, B = {"x-api-key": "ka"}, {"x-api-key": "kb"}
# 64 blocks, half of them the retention budget: 32 blocks
ENGINE = {"num_kv_blocks": 64, "max_model_len": 1024, "block_size": BLOCK}


def rules(name: str, repeats: int) -> str:
    return f"Rule book {name}. " + "Keep every tool call short and exact. " * repeats


def marked(system: str) -> dict:
    """A request whose system prompt carries a 1h ``cache_control`` mark."""
    block = {"type": "text", "text": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    return {"model": MODEL, "max_tokens": 1, "temperature": 0, "system": [block],
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip


async def post(client, headers: dict, body: dict) -> dict:
    r = await client.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    count = await client.post("/v1/messages/count_tokens", json=body, headers=headers)
    parts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert sum(usage[p] for p in parts) == count.json()["input_tokens"]
    return usage


def hour(usage: dict) -> int:
    return usage["cache_creation"]["ephemeral_1h_input_tokens"]


@run
async def test_one_key_cannot_lock_another_out_of_the_retention_budget():
    config = ServerConfig(served_model_names=[MODEL], api_keys=KEYS)
    async with inprocess(config, **ENGINE) as (client, engine):
        table = engine.engine.scheduler.kv.retention
        pool = engine.engine.scheduler.kv.pool
        assert table.budget_blocks == 32
        # key A: four marked requests of 12 blocks each; the budget holds 32 of their 48
        granted = [hour(await post(client, A, marked(rules(str(i), 8)))) for i in range(4)]
        assert granted == [192, 192, 128, 0]  # usage says what was granted, never more
        await wait_idle(engine)
        assert table.usage("team-a") == 32

        # key B asks for 24 blocks: it takes back from A down to equal shares
        b = await post(client, B, marked(rules("b", 16)))
        assert hour(b) == 16 * BLOCK and b["cache_creation_input_tokens"] == 16 * BLOCK
        await wait_idle(engine)
        assert table.usage("team-a") == table.usage("team-b") == 16
        stats = engine.snapshot().kv_cache
        assert stats["retention_revoked"] >= 16 and stats["retention_used_blocks"] == 32

        # a long unmarked prompt evicts retained blocks: they leave the budget at once
        flood = {"model": MODEL, "max_tokens": 1, "temperature": 0,
                 "messages": [{"role": "user", "content": "flood " * 185}]}  # fmt: skip
        r = await client.post("/v1/messages", json=flood, headers=A)
        assert r.status_code == 200, r.text
        stats = await wait_idle(engine)
        assert stats["retention_dropped"] > 0 and stats["retention_used_blocks"] < 32
        assert all(pool.hashed_block(h) is not None for h in table._holders)
        assert stats["retention_used_blocks"] == stats["retained_cached_blocks"]
        # the freed budget is granted again, to either key
        again = await post(client, B, marked(rules("b2", 4)))
        assert hour(again) == 6 * BLOCK  # every full block its mark covers


@run
async def test_identical_24h_requests_keep_one_session_and_a_bounded_heap():
    async with inprocess(**ENGINE) as (client, engine):
        body = {"model": MODEL, "messages": [{"role": "user", "content": rules("day", 8)}],
                "max_tokens": 1, "temperature": 0, "prompt_cache_retention": "24h"}  # fmt: skip
        ids = []
        for _ in range(100):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        stats = await wait_idle(engine)
        prompt = r.json()["usage"]["prompt_tokens"]
        assert stats["retention_sessions"] == 1
        assert stats["retained_blocks"] == stats["retention_used_blocks"] == prompt // BLOCK
        assert stats["retention_heap_entries"] <= 2 + HEAP_SLACK
        # releasing an older id leaves the prefix retained for the newer ones
        r = await client.post("/v1/kv/release", json={"id": ids[-1]})
        assert r.json()["released_blocks"] == 0
        assert (await wait_idle(engine))["retained_blocks"] == prompt // BLOCK
