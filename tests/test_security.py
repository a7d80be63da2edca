"""Security: constant-time API keys, tenant isolation through ``cache_salt`` (block level and HTTP
level), mandatory salts, safetensors-only weights, loopback by default, no prompts in INFO logs."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging

import pytest
from checkpoints import make_checkpoint
from servers import MODEL
from test_reliability import inprocess, sse_events, wait_idle

from prefixserve import LLM, SamplingParams
from prefixserve.api.server import ServerConfig
from prefixserve.core.errors import ModelLoadError
from prefixserve.entrypoints.cli import build_parser


def test_api_key_is_compared_in_constant_time(monkeypatch):
    """A key is looked up by its SHA-256 digest, then compared with ``hmac.compare_digest``."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    config = ServerConfig(served_model_names=[MODEL], api_key="sekret")

    async def main() -> None:
        async with inprocess(config) as (c, _):
            assert (
                await c.get("/v1/models", headers={"authorization": "Bearer nope"})
            ).status_code == 401
            ok = await c.get("/v1/models", headers={"authorization": "Bearer sekret"})
            assert ok.status_code == 200

    asyncio.run(main())
    assert calls == [(b"sekret", b"sekret")]  # keys are found by digest, then compared so


def test_salted_requests_share_no_block_while_running():
    llm = LLM(None, num_kv_blocks=64, max_model_len=256)
    engine = llm.llm_engine
    prompt = list(range(20, 84))  # four full blocks
    params = {salt: SamplingParams(max_tokens=4, temperature=0.0, cache_salt=salt) for salt in "AB"}
    engine.add_request("a1", prompt, params["A"])
    while engine.has_unfinished_requests():
        engine.step()  # tenant A's prompt is now in the prefix cache
    a2 = engine.add_request("a2", prompt, params["A"])
    b = engine.add_request("b", prompt, params["B"])
    engine.step()
    table_a2 = engine.scheduler.kv.get_block_table(a2.seqs[0].seq_id)
    table_b = engine.scheduler.kv.get_block_table(b.seqs[0].seq_id)
    assert len(table_a2) >= 4 and len(table_b) >= 4
    assert not set(table_a2) & set(table_b)
    assert a2.num_cached_tokens > 0 and b.num_cached_tokens == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.cache_stats()["used_blocks"] == 0


def test_cached_tokens_respect_cache_salt_over_http():
    prompt = "The tenant's long private system prompt, repeated to fill many blocks. " * 4

    async def main() -> list[int]:
        async with inprocess() as (c, engine):
            cached = []
            for salt in ("A", "A", "B", None):
                body = {"prompt": prompt, "max_tokens": 2, "cache_salt": salt}
                r = await c.post("/v1/completions", json=body)
                cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                await wait_idle(engine)
            return cached

    first_a, second_a, b, unsalted = asyncio.run(main())
    assert first_a == 0 and second_a > 0
    assert b == 0 and unsalted == 0


def test_require_cache_salt():
    config = ServerConfig(served_model_names=[MODEL], require_cache_salt=True)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main() -> None:
        async with inprocess(config) as (c, _):
            for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions", chat)):  # fmt: skip
                r = await c.post(path, json=body)
                assert r.status_code == 400
                err = r.json()["error"]
                assert err["param"] == "cache_salt" and "cache_salt" in err["message"]
                assert (await c.post(path, json={**body, "cache_salt": "t1"})).status_code == 200

    asyncio.run(main())


def test_pickle_only_checkpoint_is_refused(tmp_path):
    folder = make_checkpoint("llama", tmp_path)
    for weights in folder.glob("*.safetensors*"):
        weights.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickle would run code here")
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(model=str(tmp_path))


def test_serve_binds_loopback_by_default():
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"
    assert args.api_key is None or isinstance(args.api_key, str)
    assert args.require_cache_salt is False


def test_prompts_and_outputs_are_not_logged_at_info(caplog):
    marker = "zq7xv-secret-marker"
    caplog.set_level(logging.INFO)
    config = ServerConfig(served_model_names=[MODEL], request_timeout=5)

    async def main() -> list[str]:
        async with inprocess(config) as (c, engine):
            texts = []
            chat = {"messages": [{"role": "user", "content": marker}], "max_tokens": 4}
            comp = {"prompt": marker, "max_tokens": 4, "stop": [marker]}
            texts.append((await c.post("/v1/chat/completions", json=chat)).text)
            texts.append((await c.post("/v1/chat/completions", json={**chat, "stream": True})).text)
            texts.append((await c.post("/v1/completions", json=comp)).text)
            texts.append((await c.post("/v1/completions", json={**comp, "stream": True})).text)
            await c.post("/v1/completions", json={**comp, "temperature": -1})
            await c.post("/tokenize", json={"prompt": marker})
            await wait_idle(engine)
            return texts

    texts = asyncio.run(main())
    assert all(texts) and sse_events(texts[1])[-1] == "[DONE]"
    assert caplog.records, "expected some INFO logging to have been captured"
    assert marker not in caplog.text
    outputs = [json.loads(texts[0])["choices"][0]["message"]["content"],
               json.loads(texts[2])["choices"][0]["text"]]  # fmt: skip
    for output in outputs:  # the generated text is not logged either
        assert len(output) < 6 or output not in caplog.text
