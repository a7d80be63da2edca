"""Reliability of the HTTP server: backpressure, body limits, KV exhaustion, disconnects, timeouts,
one failing request, a dead engine loop and a graceful SIGTERM drain. Nothing admitted is lost.

In-process tests drive the ASGI app through ``httpx.ASGITransport`` over a real engine thread;
the lifecycle tests (exit codes, signals, TCP disconnects) start a real server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import pytest
from servers import MODEL, metric, scrape, server_process

from prefixserve import LLM, SamplingParams
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.engine_client import EngineOverloadedError
from prefixserve.api.server import ServerConfig, create_app
from prefixserve.core.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine


@asynccontextmanager
async def inprocess(
    config: ServerConfig | None = None,
    engine_hook: Callable[[LLMEngine], None] | None = None,
    **engine_kwargs,
) -> AsyncIterator[tuple[httpx.AsyncClient, AsyncEngine]]:
    """An app over a live engine thread, reached through ``httpx.ASGITransport``."""
    kwargs = {"num_kv_blocks": 128, "max_model_len": 256, **engine_kwargs}
    llm_engine = LLMEngine(EngineConfig(**kwargs))
    if engine_hook is not None:
        engine_hook(llm_engine)
    app = create_app(llm_engine, config or ServerConfig(served_model_names=[MODEL]))
    engine: AsyncEngine = app.state.engine
    engine.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            yield c, engine
    finally:
        await asyncio.to_thread(engine.stop)


async def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> dict:
    """Cache stats once no request runs or waits and no block is referenced."""
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot()
        if snap.num_running == snap.num_waiting == snap.kv_cache["used_blocks"] == 0:
            return snap.kv_cache
        assert time.monotonic() < deadline, f"engine not idle: {snap}"
        await asyncio.sleep(0.05)


def assert_openai_error(body: dict, code: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, body
    assert isinstance(err["message"], str) and err["message"]
    return err


def sse_events(text: str) -> list[dict | str]:
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


# ---- backpressure and body limits ---------------------------------------------------------------


def test_full_queue_gets_503_and_every_admitted_request_finishes():
    config = ServerConfig(served_model_names=[MODEL], max_waiting_requests=3)

    async def main() -> list[httpx.Response]:
        async with inprocess(config, max_num_seqs=1) as (c, engine):
            body = {"prompt": "queue", "max_tokens": 4, "ignore_eos": True}
            responses = await asyncio.gather(
                *(c.post("/v1/completions", json=body) for _ in range(24))
            )
            await wait_idle(engine)
            return responses

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(503) > 0 and codes.count(200) >= 3
    for r in responses:
        if r.status_code == 503:
            assert r.headers["retry-after"].isdigit()
            assert "overloaded" in assert_openai_error(r.json(), 503)["message"]
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 4


def test_admission_refuses_only_past_the_limit():
    """The one rule ``AsyncEngine.admit`` and the scale-out ingress's ``RemoteEngine.admit``
    share: ``count`` more requests may join ``queued`` up to the limit (None: no limit)."""
    EngineOverloadedError.check(2, 1, 3, "are waiting")
    EngineOverloadedError.check(10**6, 1, None, "are waiting")
    with pytest.raises(
        EngineOverloadedError, match=r"3 requests wait for a replica \(limit 3\)"
    ) as err:
        EngineOverloadedError.check(3, 1, 3, "wait for a replica")
    assert err.value.status == 503 and "Retry-After" in err.value.headers


def test_body_over_the_limit_gets_413():
    config = ServerConfig(served_model_names=[MODEL], max_request_body_bytes=1000)

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 100
        yield b'"}'

    async def main() -> None:
        async with inprocess(config) as (c, _):
            big = {"prompt": "y" * 2000, "max_tokens": 1}
            r = await c.post("/v1/completions", json=big)
            assert r.status_code == 413
            assert "1000 bytes" in assert_openai_error(r.json(), 413)["message"]
            r = await c.post(  # no Content-Length: the limit holds while reading
                "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
            )
            assert r.status_code == 413 and "content-length" not in r.request.headers
            r = await c.post("/v1/completions", json={"prompt": "small", "max_tokens": 1})
            assert r.status_code == 200

    asyncio.run(main())


# ---- KV exhaustion: preemption, nothing lost, same outputs ----------------------------------------


def test_200_concurrent_requests_on_a_cache_for_20():
    # 12 prompt tokens fill one block at admission; decoding 8 more needs a second one, which is
    # where a cache for about 20 requests (40 blocks) runs out and the scheduler preempts.
    prompts = [[random.Random(i).randrange(10, 700) for _ in range(12)] for i in range(200)]
    reference = LLM(None, num_kv_blocks=1024, max_model_len=256).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    num_blocks = 20 * 2

    async def main() -> tuple[list[httpx.Response], int]:
        async with inprocess(num_kv_blocks=num_blocks) as (c, engine):
            responses = await asyncio.gather(
                *(
                    c.post(
                        "/v1/completions",
                        json={"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                    )
                    for p in prompts
                )
            )
            await wait_idle(engine, timeout=60)
            return responses, engine.snapshot().num_preemptions

    responses, preemptions = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 200
    got = [r.json()["choices"][0]["text"] for r in responses]
    assert got == [o.outputs[0].text for o in reference]
    assert preemptions > 0


# ---- timeouts and one failing request -------------------------------------------------------------


def test_request_timeout_gives_408_or_a_timeout_event_and_frees_blocks():
    config = ServerConfig(served_model_names=[MODEL], request_timeout=0.3)
    long = {"prompt": "never ends", "max_tokens": 1000, "ignore_eos": True}

    async def main() -> None:
        async with inprocess(config, max_model_len=1024) as (c, engine):
            r = await c.post("/v1/completions", json=long)
            assert r.status_code == 408
            assert assert_openai_error(r.json(), 408)["type"] == "timeout_error"
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], **long, "stream": True
            })  # fmt: skip
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            assert assert_openai_error(events[-2], 408)["type"] == "timeout_error"
            await wait_idle(engine)
            r = await c.post("/v1/completions", json={"prompt": "quick", "max_tokens": 2})
            assert r.status_code == 200

    asyncio.run(main())


MARK = [3, 1, 4, 1, 5, 9, 2, 6]  # prompts starting with these token ids fail in the detokenizer


def break_marked_requests(llm_engine: LLMEngine) -> None:
    """Make detokenization raise for every sequence of a request whose prompt starts with MARK."""
    add_request = llm_engine.scheduler.add_request

    def patched(request) -> None:
        seq = request.seqs[0]
        if request.prompt_token_ids[: len(MARK)] == MARK and seq.detokenizer is not None:

            def broken(new_token_ids: list[int]) -> str | None:
                raise RuntimeError("injected detokenizer failure")

            seq.detokenizer.update = broken
        add_request(request)

    llm_engine.scheduler.add_request = patched


def test_one_failing_request_fails_alone():
    async def main() -> None:
        async with inprocess(engine_hook=break_marked_requests) as (c, engine):
            good = {"prompt": "healthy neighbour", "max_tokens": 6, "ignore_eos": True}
            bad = {"prompt": [*MARK, 10, 11], "max_tokens": 6}
            results = await asyncio.gather(
                c.post("/v1/completions", json=bad),
                c.post("/v1/completions", json={**bad, "stream": True}),
                *(c.post("/v1/completions", json=good) for _ in range(3)),
            )
            failed, streamed, *ok = results
            assert failed.status_code == 500
            assert assert_openai_error(failed.json(), 500)["type"] == "internal_error"
            events = sse_events(streamed.text)
            assert events[-1] == "[DONE]"
            assert assert_openai_error(events[-2], 500)["type"] == "internal_error"
            assert [r.status_code for r in ok] == [200] * 3
            assert all(r.json()["usage"]["completion_tokens"] == 6 for r in ok)
            await wait_idle(engine)
            assert engine.dead is None
            assert (await c.get("/health")).status_code == 200

    asyncio.run(main())


def fail_first_forward(llm_engine: LLMEngine) -> None:
    execute, calls = llm_engine.runner.execute, []

    def failing(scheduler_output):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return execute(scheduler_output)

    llm_engine.runner.execute = failing


def test_failed_forward_fails_its_requests_and_poisons_no_cache():
    """The first forward raises: its request gets a 500, the server keeps serving, and the same
    prompt again is exact (nothing from the failed step is cached)."""
    prompt = list(range(3, 103))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def main() -> None:
        async with inprocess(engine_hook=fail_first_forward) as (c, engine):
            failed = await c.post("/v1/completions", json=body)
            assert failed.status_code == 500 and "device fault" in failed.text
            first, second = [await c.post("/v1/completions", json=body) for _ in range(2)]
            assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # the first run's full blocks and its partial tail: all but the last prompt token
            assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 99
            texts.extend(r.json()["choices"][0]["text"] for r in (first, second))
            await wait_idle(engine)
            assert engine.dead is None

    texts: list[str] = []
    asyncio.run(main())
    fresh = LLM(num_kv_blocks=128, max_model_len=256)
    ref = fresh.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert texts == [ref[0].outputs[0].text] * 2


# ---- real server processes: death, disconnects, drain ---------------------------------------------


def test_dead_engine_loop_turns_health_503_and_exits_non_zero():
    env = {"PREFIXSERVE_FAULT_INJECT": "step_after:3"}
    with server_process(env=env, num_kv_blocks=256) as (proc, base):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 20}, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        with contextlib.suppress(httpx.TransportError):  # already gone: also fine
            assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        assert proc.wait(timeout=30) == 1


@pytest.fixture(scope="module")
def drain_server():
    with server_process("--shutdown-grace-seconds", "2", num_kv_blocks=256) as (proc, base):
        yield proc, base


def test_random_disconnects_leave_nothing_running(drain_server):
    _, base = drain_server
    rng = random.Random(0)

    async def stream_then_leave(c: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": f"leave {i}", "max_tokens": 300, "stream": True, "ignore_eos": True}
        if i % 2:
            body = {"messages": [{"role": "user", "content": f"leave {i}"}], **body}
        path = "/v1/chat/completions" if i % 2 else "/v1/completions"
        stay_for = rng.randint(0, 12)
        async with c.stream("POST", base + path, json=body) as r:
            seen = 0
            async for _ in r.aiter_lines():
                seen += 1
                if seen >= stay_for:
                    break

    async def post_then_leave(c: httpx.AsyncClient, i: int) -> None:
        # 1,000 tokens cannot finish within the timeout, however quiet the machine
        body = {"prompt": f"wait {i}", "max_tokens": 1000, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            await c.post(base + "/v1/completions", json=body, timeout=rng.uniform(0.2, 1.0))

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(
                *(stream_then_leave(c, i) for i in range(40)),
                *(post_then_leave(c, i) for i in range(8)),
            )

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while True:
        samples = scrape(base)
        running = metric(samples, "prefixserve_num_requests_running")
        used = metric(samples, "prefixserve_kv_blocks", state="used")
        if running == used == 0:
            break
        assert time.monotonic() < deadline, f"running={running} used={used}"
        time.sleep(0.1)
    assert httpx.get(f"{base}/health").status_code == 200


def test_sigterm_drains_then_exits_zero(drain_server):
    proc, base = drain_server
    results: dict[str, list] = {}

    async def stream(name: str, max_tokens: int, started: asyncio.Event) -> None:
        body = {"prompt": name, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        events: list = []
        async with (
            httpx.AsyncClient(timeout=60) as c,
            c.stream("POST", f"{base}/v1/completions", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    started.set()
        results[name] = events

    async def main() -> None:
        short_started, long_started = asyncio.Event(), asyncio.Event()
        short = asyncio.create_task(stream("short", 40, short_started))
        long = asyncio.create_task(stream("long", 1000, long_started))
        await short_started.wait()
        await long_started.wait()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(f"{base}/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"].isdigit()
        assert "shutting down" in assert_openai_error(r.json(), 503)["message"]
        await asyncio.gather(short, long)

    asyncio.run(main())
    for name in ("short", "long"):
        events = results[name]
        assert events[-1] == "[DONE]", name
        last = events[-2]
        if "error" in last:
            assert_openai_error(last, 503)
        else:
            assert last["choices"][0]["finish_reason"] == "length", name
    assert results["short"][-2]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0
