"""The KV tiers as untrusted input and as a shared resource (issue 34, items 1, 2, 9, 13's
tier quota and the stale tier counters), over HTTP: a real ``prefixserve serve`` on a real Valkey whose blocks are rewritten
cut in half (signed with the right secret: the shape check alone stands) or forged (values
changed, signed under another key), then two tenants and "24h" retentions against the disk and
shared tiers of an in-process server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
import valkey
from aio import run
from safetensors.torch import load as st_load
from servers import MODEL, launch_server
from test_reliability import inprocess, wait_idle
from valkey_server import ValkeyProcess

from prefixserve.api.server import ServerConfig
from prefixserve.kv.tiers.payload import BlobFormat, read_header
from prefixserve.kv.tiers.secret import mac_key
from prefixserve.kv.tiers.shared import KEY_PREFIX

SECRET = "the replicas' shared secret"
PROMPT = "Answer from the documents. " + "The tier is untrusted input. " * 6
BLOCK = 16


@pytest.fixture
def valkey_server(tmp_path):
    server = ValkeyProcess(tmp_path)
    yield server
    server.kill()


def complete(base: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_tokens_as_token_ids": True}  # fmt: skip
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def tamper(url: str, how: str) -> int:
    """Rewrite every block in the server; the number rewritten."""
    client = valkey.Valkey.from_url(url)
    keys = client.keys(f"{KEY_PREFIX}*")
    for name in keys:
        data = client.get(name)
        meta = read_header(data)
        kv = st_load(data)["kv"]
        if how == "half":  # the attacker even knows the secret: only the shape check is left
            cut = kv[:, :, : kv.shape[2] // 2].contiguous()
            fmt = BlobFormat(meta["fingerprint"], mac_key(SECRET), tuple(cut.shape), cut.dtype)
            tensors = {"kv": cut}
        else:  # forged values, signed under a guessed key
            fmt = BlobFormat(meta["fingerprint"], mac_key("a guess"), tuple(kv.shape), kv.dtype)
            tensors = {"kv": kv + 0.5 * torch.randn_like(kv)}
        client.set(name, fmt.encode(fmt.header_key(meta), tensors))
    client.close()
    return len(keys)


@pytest.mark.parametrize("how", ["half", "forged"])
def test_a_tampered_shared_tier_is_a_miss_on_every_replica(valkey_server, how):
    flags = ("--num-kv-blocks", "24", "--kv-shared-url", valkey_server.url,
             "--kv-tier-secret", SECRET)  # fmt: skip
    with launch_server(*flags) as base:
        first = complete(base, PROMPT)
        for _ in range(100):  # write-through runs on the tier worker
            if len(valkey.Valkey.from_url(valkey_server.url).keys(f"{KEY_PREFIX}*")) >= 8:
                break
            httpx.get(f"{base}/health")
        assert tamper(valkey_server.url, how) >= 8
        for i in range(6):  # unrelated prompts push the prompt's blocks out of the pool
            complete(base, f"flood {i} " + "unrelated words fill the pool " * 5)
        again = complete(base, PROMPT)
        shared = httpx.get(f"{base}/stats").json()["kv_tiers"]["tiers"]["SHARED"]
        assert httpx.get(f"{base}/health").status_code == 200
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert shared["corrupt"] >= 1 and shared["hits"] == 0
    tamper(valkey_server.url, how)  # the blocks the second turn wrote back, tampered again
    with launch_server(*flags) as fresh:  # a fresh replica on the same server
        assert complete(fresh, PROMPT)["choices"][0]["text"] == first["choices"][0]["text"]


@run
async def test_identical_24h_requests_write_each_block_once(valkey_server):
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "prompt_cache_retention": "24h",
            "messages": [{"role": "user", "content": PROMPT}]}  # fmt: skip
    engine_kw = {"num_kv_blocks": 64, "block_size": BLOCK, "kv_shared_url": valkey_server.url,
                 "kv_tier_secret": SECRET}  # fmt: skip
    async with inprocess(None, **engine_kw) as (client, engine):
        for _ in range(10):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        await wait_idle(engine)
        blocks = r.json()["usage"]["prompt_tokens"] // BLOCK
        for _ in range(500):  # the engine idles; /stats follows the tier worker all the same
            stats = engine.snapshot().kv_tiers
            if stats["pending_store_bytes"] == 0 and stats["tiers"]["SHARED"]["stores"] >= blocks:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        stats = (await client.get("/stats")).json()["kv_tiers"]
    assert stats["tiers"]["SHARED"]["stores"] == blocks  # not 10 times that
    assert stats["stores_dropped"] == 0


@run
async def test_one_tenants_retained_blocks_cannot_fill_a_tier(tmp_path):
    """Key A's "24h" blocks fill the disk tier; key B's blocks still get their place: A's
    retained blocks past its half of the tier go before B's."""
    blob = 4 * 2 * BLOCK * 2 * 64 * 4 + 1024  # tiny-random: 4 layers, 2 KV heads of 64, float32
    engine_kw = {"num_kv_blocks": 64, "block_size": BLOCK, "kv_retention_budget": 1.0,
                 "kv_cache_dir": str(tmp_path), "kv_cache_dir_size": 16 * blob / 2**30}  # fmt: skip
    config = ServerConfig(served_model_names=[MODEL], api_keys={"ka": "team-a", "kb": "team-b"})

    async def post(key: str, text: str, retention: str | None = None) -> None:
        body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "prompt": text}
        if retention:
            body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
                    "prompt_cache_retention": retention,
                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
        path = "/v1/chat/completions" if retention else "/v1/completions"
        r = await client.post(path, json=body, headers={"x-api-key": key})
        assert r.status_code == 200, r.text
        await wait_idle(engine)
        while tiers.stats()["pending_store_bytes"]:  # the tier worker's writes are done
            await asyncio.sleep(0.01)

    def on_disk() -> set[int]:
        return {k.block_hash for k in disk.stored_keys()}

    async with inprocess(config, **engine_kw) as (client, engine):
        tiers = engine.engine.kv_tiers
        (disk,) = tiers.tiers
        for i in range(4):
            await post("ka", f"team a's document {i}: " + "retained for a day " * 8, "24h")
        assert len(on_disk()) == 16  # the tier is full of A's retained blocks
        before = on_disk()
        await post("kb", "team b's question: " + "a plain cached prompt " * 3)
        b_blocks = on_disk() - before
        assert len(b_blocks) >= 2
        await post("kb", "team b's next question: " + "another plain prompt " * 3)
        assert b_blocks <= on_disk()  # B's first prompt is still there: A's oldest went
        stats = engine.snapshot().kv_cache
    assert stats["retention_used_blocks"] >= 16
