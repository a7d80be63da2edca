"""Issue 34, the HTTP front door (docs/reliability.md "The front door"): every route but /health
behind the key, tokenization off the event loop, a client's ``chat_template`` refused or bounded,
nothing generated for a refused request, type confusion as shaped 400s, a generic handler that
keeps the connection, ``cache_control`` and stop lists capped, ``Bearer`` required, non-finite
floats refused. Each over HTTP: in-process (``httpx.ASGITransport``) or a uvicorn thread where
the connection itself matters."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from servers import MODEL, free_port
from test_reliability import inprocess, wait_idle
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from prefixserve.api.anthropic import messages as anthropic_messages
from prefixserve.api.openai import chat
from prefixserve.api.openai.responses import serving as responses_serving
from prefixserve.api.server import ServerConfig, create_app
from prefixserve.core.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine

KEY = "front-door-key"
AUTH = {"authorization": f"Bearer {KEY}"}
ANTHROPIC = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
HI = [{"role": "user", "content": "hi"}]
KEYED = ServerConfig(served_model_names=[MODEL], api_key=KEY)


@contextmanager
def thread_server(config: ServerConfig) -> Iterator[str]:
    """A real uvicorn server in a thread (real connections and keep-alive): its base URL."""
    app = create_app(LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256)), config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(),
                                           log_level="critical"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture(scope="module")
def live() -> Iterator[str]:
    with thread_server(KEYED) as base:
        yield base


def run(main) -> None:
    asyncio.run(main())


# -- item 3: the key, the event loop, client templates ---------------------------------------------


def test_every_route_but_health_and_public_ones_takes_the_key():
    config = ServerConfig(served_model_names=[MODEL], api_key=KEY, public_routes=["/metrics"])

    async def main() -> None:
        async with inprocess(config) as (c, _):
            calls = [("GET", "/version", None), ("GET", "/stats", None),
                     ("GET", "/dashboard", None), ("GET", "/v1/models", None),
                     ("POST", "/tokenize", {"prompt": "hi"}),
                     ("POST", "/detokenize", {"tokens": [1, 2]})]  # fmt: skip
            for method, path, body in calls:
                refused = await c.request(method, path, json=body)
                assert refused.status_code == 401, path
                assert refused.json()["error"]["code"] == 401
                assert (await c.request(method, path, json=body, headers=AUTH)).status_code == 200
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200  # --public-route /metrics

    run(main)


def test_a_public_route_is_never_a_v1_path():
    with pytest.raises(ValueError, match="public_routes"):
        ServerConfig(served_model_names=[MODEL], public_routes=["/v1/models"])


def test_health_answers_within_1s_while_a_4mb_prompt_is_tokenized():
    prompt = "lorem ipsum dolor sit amet " * 144_000  # 3.9 MB, under the 4 MiB body limit

    async def main() -> None:
        async with inprocess() as (c, _):
            big = asyncio.create_task(c.post("/tokenize", json={"prompt": prompt}))
            await asyncio.sleep(0.5)  # the body is read and tokenizing
            start = time.monotonic()
            health = await c.get("/health")
            waited = time.monotonic() - start
            assert not big.done(), "tokenizing finished first: the check proves nothing"
            assert health.status_code == 200 and waited < 1.0, waited
            assert (await big).json()["count"] > 1_000_000

    run(main)


def test_a_client_chat_template_is_refused_by_default():
    template = "{{ 'ab ' * 1000000 }}"

    async def main() -> None:
        async with inprocess() as (c, engine):
            for path, body in (("/tokenize", {"messages": HI}),
                               ("/v1/chat/completions", {"model": MODEL, "messages": HI})):  # fmt: skip
                r = await c.post(path, json={**body, "chat_template": template})
                assert r.status_code == 400, path
                err = r.json()["error"]
                assert err["param"] == "chat_template"
                assert "--allow-client-chat-template" in err["message"]
            assert engine.snapshot().prompt_tokens == 0

    run(main)


BOUNDED = [
    "{{ 'ab ' * 1000000 }}",  # the 92-byte body: a million tokens
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = namespace(t='ab') %}{% for i in range(40) %}{% set s.t = s.t ~ s.t %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ '%999999999d' % 1 }}",
]


def test_an_allowed_client_template_renders_under_bounds():
    config = ServerConfig(served_model_names=[MODEL], allow_client_chat_template=True)

    async def main() -> None:
        async with inprocess(config) as (c, _):
            fine = await c.post("/tokenize", json={
                "messages": HI, "add_special_tokens": False,
                "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"})  # fmt: skip
            assert fine.status_code == 200
            text = (await c.post("/detokenize", json={"tokens": fine.json()["tokens"]})).json()
            assert text["prompt"] == "<user>hi"
            for template in BOUNDED:
                start = time.monotonic()
                for path, body in (("/tokenize", {"messages": HI}),
                                   ("/v1/chat/completions", {"model": MODEL, "messages": HI})):  # fmt: skip
                    r = await c.post(path, json={**body, "chat_template": template})
                    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
                assert time.monotonic() - start < 10, template  # bounded work, not 10^10 steps

    run(main)


# -- item 4: a refused request generates nothing ---------------------------------------------------


def test_a_refused_tool_message_reaches_no_engine():
    messages = [*HI, {"role": "assistant", "content": None, "tool_calls": [{"id": "c1",
                "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": [], "content": "ok"}]  # fmt: skip

    async def main() -> None:
        async with inprocess() as (c, engine):
            r = await c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "n": 4, "max_tokens": 64})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            await asyncio.sleep(0.3)
            stats = engine.snapshot()
            assert stats.prompt_tokens == stats.generation_tokens == 0

    run(main)


def test_an_error_after_the_add_aborts_what_was_added(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug after the add")

    for module in (chat, anthropic_messages, responses_serving):  # each handler's last step once added
        monkeypatch.setattr(module, "event_stream", broken)

    async def main() -> None:
        async with inprocess() as (c, engine):
            for path, body, headers in (
                ("/v1/chat/completions", {"messages": HI, "n": 4, "max_tokens": 200,
                                          "ignore_eos": True, "stream": True}, {}),
                ("/v1/messages", {"messages": HI, "max_tokens": 200, "stream": True}, ANTHROPIC),
                ("/v1/responses", {"input": "hi", "max_output_tokens": 200, "store": False,
                                   "stream": True}, {}),
            ):  # fmt: skip
                before = engine.snapshot().generation_tokens
                r = await c.post(path, headers=headers, json={"model": MODEL, **body})
                assert r.status_code == 500, path
                await wait_idle(engine)
                assert engine.snapshot().generation_tokens - before < 100, path  # not 200 (x4)

    run(main)


# -- item 5: type confusion, the generic handler ---------------------------------------------------


def test_type_confusion_is_a_400_in_the_routes_shape():
    async def main() -> None:
        async with inprocess() as (c, engine):
            marked = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral",
                                                                         "ttl": ["1h"]}}]  # fmt: skip
            r = await c.post("/v1/messages", headers=ANTHROPIC, json={
                "model": MODEL, "max_tokens": 4,
                "messages": [{"role": "user", "content": marked}]})  # fmt: skip
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
            for body in ({"input": "hi", "text": {"format": "json"}},
                         {"input": [{"type": "message", "role": ["user"], "content": "hi"}]},
                         {"input": "hi", "tools": [{"type": "custom", "name": "x", "format": 3}]}):  # fmt: skip
                r = await c.post("/v1/responses", json={"model": MODEL, **body})
                assert r.status_code == 400, body
                assert r.json()["error"]["code"] == 400 and r.json()["error"]["message"]
            assert engine.snapshot().prompt_tokens == 0

    run(main)


def _port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_an_unexpected_error_is_a_shaped_500_and_keeps_the_connection(live, monkeypatch):
    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr("prefixserve.api.openai.chat.tool_results", broken)
    monkeypatch.setattr("prefixserve.api.anthropic.messages.breakpoints", broken)
    with httpx.Client(base_url=live, timeout=30) as c:
        chat = c.post("/v1/chat/completions", headers=AUTH, json={"model": MODEL, "messages": HI})
        assert chat.status_code == 500
        assert chat.json()["error"]["type"] == "internal_error"
        msgs = c.post("/v1/messages", headers=ANTHROPIC,
                      json={"model": MODEL, "max_tokens": 4, "messages": HI})  # fmt: skip
        assert msgs.status_code == 500 and msgs.json()["type"] == "error"
        assert msgs.json()["error"]["type"] == "api_error"
        after = c.get("/v1/models", headers=AUTH)
        assert after.status_code == 200
        assert _port(chat) == _port(msgs) == _port(after)  # one connection served all three


# -- item 6: cache_control marks -------------------------------------------------------------------


def test_20000_cache_control_marks_are_a_400_within_1s():
    blocks = [{"type": "text", "text": f"b{i}", "cache_control": {"type": "ephemeral"}}
              for i in range(20_000)]  # fmt: skip

    async def main() -> None:
        async with inprocess(max_model_len=256) as (c, _):
            body = {"model": MODEL, "max_tokens": 4,
                    "messages": [{"role": "user", "content": blocks}]}  # fmt: skip
            start = time.monotonic()
            r = await c.post("/v1/messages", headers=ANTHROPIC, json=body)
            assert time.monotonic() - start < 1.0
            assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]

    run(main)


# -- item 13: the stop list ------------------------------------------------------------------------


def test_stop_lists_are_capped_in_count_and_length():
    async def main() -> None:
        async with inprocess() as (c, engine):
            chat = {"model": MODEL, "messages": HI, "max_tokens": 2}
            ok = await c.post("/v1/chat/completions", json={**chat, "stop": [f"s{i}" for i in range(64)]})  # fmt: skip
            assert ok.status_code == 200
            await wait_idle(engine)
            before = engine.snapshot().prompt_tokens
            refused = [
                ("/v1/chat/completions", {**chat, "stop": [f"s{i}" for i in range(30_000)]}, {}),
                ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["x" * 1025]}, {}),
                ("/v1/chat/completions", {**chat, "stop_token_ids": list(range(65))}, {}),
                ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 2,
                                  "stop_sequences": [f"s{i}" for i in range(65)]}, ANTHROPIC),
            ]  # fmt: skip
            for path, body, headers in refused:
                r = await c.post(path, json=body, headers=headers)
                assert r.status_code == 400, (path, r.text[:200])
                assert "at most" in r.json()["error"]["message"]
            assert engine.snapshot().prompt_tokens == before

    run(main)


# -- low: Bearer, the WebSocket refusal, non-finite floats -----------------------------------------


def test_an_authorization_header_without_bearer_is_refused(live):
    for headers in ({"authorization": KEY}, {"authorization": f"Basic {KEY}"}):
        assert httpx.get(f"{live}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{live}/v1/models", headers={"authorization": f"bearer {KEY}"}).is_success


def test_a_refused_websocket_upgrade_is_the_401_a_post_gets(live):
    url = live.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, additional_headers={"authorization": KEY}).close()
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == 401  # a POST's body
    connect(url, additional_headers=AUTH).close()


def test_non_finite_sampling_floats_are_a_400_on_every_protocol():
    calls = [
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], '
                                 '"max_tokens": 2, "temperature": 1e400}', {}),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "max_tokens": 2, '
                            '"repetition_penalty": 1e400}', {}),
        ("/v1/completions", '{"model": "%s", "prompt": "hi", "max_tokens": 2, '
                            '"logit_bias": {"5": NaN}}', {}),
        ("/v1/responses", '{"model": "%s", "input": "hi", "top_p": NaN}', {}),
        ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
                         '"content": "hi"}], "temperature": -1e400}', ANTHROPIC),
    ]  # fmt: skip

    async def main() -> None:
        async with inprocess() as (c, engine):
            for path, body, headers in calls:
                headers = {"content-type": "application/json", **headers}
                r = await c.post(path, content=body % MODEL, headers=headers)
                assert r.status_code == 400, (path, r.text[:200])
            assert engine.snapshot().prompt_tokens == 0

    run(main)
