"""The OpenAI-compatible server, end to end: a real ``prefixserve serve`` process and the official
``openai`` client. One server for the module (plus a second one for the API key)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from servers import MODEL, launch_server, metric, scrape


@pytest.fixture(scope="module")
def server():
    with launch_server("--tool-call-parser", "hermes") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


CHAT = [{"role": "user", "content": "Tell me about prefix caching."}]


def test_models_version_tokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/version").json()["version"]
    tok = httpx.post(f"{server}/tokenize", json={"prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("hello world")


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_non_stream(client):
    prompt = "Once upon a time, in a test of streaming that no other test sends, " * 2
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.usage.prompt_tokens_details.cached_tokens == 0  # never seen before
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    # the second time every full block of the prompt but the last token's is cached
    num_prompt = full.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16


def test_n_choices_and_prompt_lists(client):
    out = client.completions.create(
        model=MODEL, prompt=["a b c", "d e f"], n=3, max_tokens=4, temperature=1.0, seed=1
    )
    assert sorted(c.index for c in out.choices) == list(range(6))
    assert out.usage.completion_tokens == sum(4 for _ in out.choices)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1]
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_tokens=4, stream=True
    )
    finished = sorted(
        c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason
    )
    assert finished == [0, 1]


def test_logprobs(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)  # greedy
    comp = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, logprobs=2, temperature=0
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_and_seed(client):
    base = client.completions.create(model=MODEL, prompt="xyz", max_tokens=12, temperature=0)
    text = base.choices[0].text
    stop = text[3:5] if len(text) > 5 else text[-1]
    cut = client.completions.create(
        model=MODEL, prompt="xyz", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)
    runs = [
        client.completions.create(
            model=MODEL, prompt="seeded", max_tokens=8, temperature=1.0, seed=1234
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_beam_search(client):
    out = client.completions.create(
        model=MODEL,
        prompt="beam me",
        n=3,
        max_tokens=5,
        extra_body={"use_beam_search": True, "length_penalty": 1.0},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_tokens=4, extra_body={"use_beam_search": True}
    )
    assert len(chat.choices) == 2


def test_cached_tokens_for_repeated_system_prompt(server, client):
    system = "You are prefixserve's test assistant. Follow every rule in this long preamble. " * 8
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    ids_first = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()["tokens"]
    messages[1]["content"] = "second question"
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    ids_again = httpx.post(f"{server}/tokenize", json={"messages": messages}).json()["tokens"]
    shared = len(system.encode())  # byte-level tokenizer: at least one token per 4 bytes is shared
    assert first.usage.prompt_tokens == len(ids_first) > shared // 4
    # cached: the full blocks before the prompts differ, and, when they differ inside the first
    # request's partial last block (its prompt and first output token), that block's shared
    # start too (a partial tail)
    common = next(i for i, (a, b) in enumerate(zip(ids_first, ids_again)) if a != b)
    tail_start = (len(ids_first) + 1) // 16 * 16
    expected = common if common >= tail_start else common // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == expected >= (shared // 4 // 16) * 16


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"model": MODEL}, None),  # no messages
        ("/v1/chat/completions", {"messages": "hi"}, None),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "messages"),
    ],
)
def test_bad_requests_are_400(server, path, body, param):
    r = httpx.post(server + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_malformed_json_unknown_model_and_context_length(server, client):
    r = httpx.post(
        f"{server}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1024)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.completions.create(model=MODEL, prompt=[7] * 1100, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x" * 2000}], stream=True
        )
    r = httpx.post(
        f"{server}/v1/completions", json={"prompt": "hi", "extra_field": 1, "max_tokens": 1}
    )
    assert r.status_code == 200
    assert httpx.get(f"{server}/health").status_code == 200


def test_tools_reach_the_template(server, client):
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    plain = httpx.post(f"{server}/tokenize", json={"messages": CHAT}).json()["count"]
    out = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, max_tokens=3)
    assert out.usage.prompt_tokens > plain + 20
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_64_concurrent_streams(server):
    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"client {i}"}],
            max_tokens=4,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def main() -> list:
        aclient = openai.AsyncOpenAI(
            base_url=f"{server}/v1",
            api_key="unused",
            max_retries=0,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)),
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(64)))

    texts = asyncio.run(main())
    assert len(texts) == 64 and all(isinstance(t, str) for t in texts)


def _wait_idle(server: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        idle = (
            metric(samples, "prefixserve_num_requests_running") == 0
            and metric(samples, "prefixserve_num_requests_waiting") == 0
            and metric(samples, "prefixserve_kv_blocks", state="used") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_disconnects_abort_and_free_blocks(server):
    async def stream_then_leave(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"leave early {i}", "max_tokens": 500, "stream": True, "ignore_eos": True}
        async with c.stream("POST", f"{server}/v1/completions", json=body) as r:
            async for _ in r.aiter_lines():
                break

    async def post_then_leave(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"wait {i}", "max_tokens": 500, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await c.post(f"{server}/v1/completions", json=body, timeout=0.5)

    async def main() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            await asyncio.gather(
                *(stream_then_leave(c, i) for i in range(16)),
                *(post_then_leave(c, i) for i in range(4)),
            )

    asyncio.run(main())
    samples = _wait_idle(server)
    assert metric(samples, "prefixserve_num_requests_running") == 0
    assert metric(samples, "prefixserve_kv_blocks", state="used") == 0
    assert metric(samples, "prefixserve_generation_tokens_total") < 20 * 500


def test_metrics_names(server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    samples = scrape(server)
    for name in [
        "prefixserve_prefix_cache_queries_total",
        "prefixserve_prefix_cache_hits_total",
        "prefixserve_kv_cache_usage_ratio",
        "prefixserve_kv_evictions_total",
        "prefixserve_kv_cow_copies_total",
        "prefixserve_prefix_cache_tail_hits_total",
        "prefixserve_prefix_cache_tail_hit_tokens_total",
        "prefixserve_num_requests_running",
        "prefixserve_num_requests_waiting",
        "prefixserve_num_preemptions_total",
        "prefixserve_prompt_tokens_total",
        "prefixserve_generation_tokens_total",
        "prefixserve_time_to_first_token_seconds_count",
        "prefixserve_inter_token_latency_seconds_count",
        "prefixserve_e2e_request_latency_seconds_count",
    ]:
        metric(samples, name)  # raises KeyError when the series is missing
    assert metric(samples, "prefixserve_request_success_total", finish_reason="length") >= 1
    blocks = [metric(samples, "prefixserve_kv_blocks", state=s) for s in ("free", "cached", "used")]
    assert sum(blocks) == 512  # the server's --num-kv-blocks: every block in exactly one state
    stats = httpx.get(f"{server}/stats").json()  # steps and their seconds by phase, as offline
    assert stats["num_steps"] >= 3
    assert set(stats["step_times"]) == {"schedule", "prepare", "forward", "sample", "output"}
    assert 0 < stats["step_times"]["forward"] < 1e4


def test_api_key():
    with launch_server("--api-key", "sekret", "--public-route", "/metrics") as base:
        ok = openai.OpenAI(base_url=f"{base}/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=f"{base}/v1", api_key=key or "x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200  # public by --public-route
        assert httpx.get(f"{base}/stats").status_code == 401


def test_engine_death_makes_health_503():
    from fastapi.testclient import TestClient

    from prefixserve.api.server import ServerConfig, create_app
    from prefixserve.core.config import EngineConfig
    from prefixserve.engine.llm_engine import LLMEngine

    llm_engine = LLMEngine(EngineConfig(num_kv_blocks=64, max_model_len=256))

    def broken_step():
        raise RuntimeError("simulated device failure")

    llm_engine.step = broken_step
    deaths = []
    app = create_app(llm_engine, ServerConfig(served_model_names=[MODEL]), deaths.append)
    with TestClient(app) as tc:
        assert tc.get("/health").status_code == 200
        r = tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and "engine" in r.json()["error"]["message"]
        assert tc.get("/health").status_code == 503
        assert tc.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 500
    assert len(deaths) == 1
