"""Bad input: schemathesis fuzzing over the server's own OpenAPI schema, then explicit nasty cases.

Every generated request must get a non-5xx answer, and every 4xx must be an OpenAI-shaped error
body. The server runs in this process (uvicorn in a thread) with a 16-token context, so no
generated request can ask for much work; the fuzzer is derandomized so each run sends the same
cases (at least ``MIN_CASES`` of them).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import requests
import schemathesis
import uvicorn
from hypothesis import HealthCheck, Phase, given, settings
from servers import MODEL, free_port

from prefixserve.api.server import ServerConfig, create_app
from prefixserve.core.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine

MIN_CASES = 500
EXAMPLES_PER_POST = 130  # 6 POST operations; the GET ones add a few more
EXAMPLES_PER_GET = 5


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[str, dict]]:
    """(base URL, OpenAPI schema) of an in-thread server with a tiny context and KV pool."""
    llm_engine = LLMEngine(EngineConfig(num_kv_blocks=96, max_model_len=16, max_num_seqs=32))
    app = create_app(llm_engine, ServerConfig(served_model_names=[MODEL]))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.05)
    try:
        yield base, app.openapi()
    finally:
        server.should_exit = True
        thread.join(timeout=20)


def check_response(status: int, body: bytes, where: str, anthropic: bool = False) -> None:
    """No 5xx; a 4xx is OpenAI's error shape (Anthropic's on the Messages routes)."""
    assert status < 500, f"{where}: {status} {body[:500]!r}"
    if 400 <= status < 500 and anthropic:
        content = json.loads(body)
        assert content["type"] == "error" and set(content["error"]) == {"type", "message"}, where
        assert isinstance(content["error"]["message"], str) and content["error"]["message"]
    elif 400 <= status < 500:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, f"{where}: {body[:300]!r}"
        assert err["code"] == status and isinstance(err["message"], str) and err["message"]


def fuzz_operation(operation, base: str, session: requests.Session, counts: Counter) -> None:
    """Send the derandomized cases of one operation; check each answer."""
    label = f"{operation.method.upper()} {operation.path}"
    examples = EXAMPLES_PER_POST if operation.method.lower() == "post" else EXAMPLES_PER_GET

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case) -> None:
        r = case.call(base_url=base, session=session, timeout=60)
        counts[label] += 1
        where = f"{label} {case.body!r}"[:800]
        check_response(r.status_code, r.content, where, operation.path.startswith("/v1/messages"))

    run()


def test_schemathesis_finds_no_5xx_and_only_openai_errors(live):
    base, raw = live
    schema = schemathesis.openapi.from_dict(raw)
    counts: Counter[str] = Counter()
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            fuzz_operation(operation, base, session, counts)
    assert sum(counts.values()) >= MIN_CASES, counts
    assert httpx.get(f"{base}/health").status_code == 200


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "content", "status", "hint"),
    [
        (COMPLETIONS, {"prompt": [1, 2, 716]}, 400, "outside the vocabulary"),
        (COMPLETIONS, {"prompt": [[5, -1]]}, 400, "outside the vocabulary"),
        ("/detokenize", {"tokens": [10**12]}, 400, "outside the vocabulary"),
        (COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
        (COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        (CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested"),
        (COMPLETIONS, {"prompt": "hi", "n": 10**6}, 400, "n:"),
        (CHAT, {"messages": USER, "n": 17}, 400, "n:"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6}, 400, "maximum context length"),
        (CHAT, {"messages": USER, "max_tokens": 10**30}, 400, "maximum context length"),
        (CHAT, {"messages": USER, "max_completion_tokens": 17}, 400, "maximum context length"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 10**6}, 400, "logprobs"),
        (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 1000}, 400, "top_logprobs"),
        (CHAT, {"messages": []}, 400, "messages"),
        (COMPLETIONS, {"prompt": []}, 400, "prompt"),
        (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
        (COMPLETIONS, {"prompt": 12}, 400, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        (COMPLETIONS, {"prompt": "hi", "seed": 2**80}, 400, "seed"),
        (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": [{"role": 5, "content": "x"}]}, 400, "role"),
        (CHAT, [1, 2, 3], 400, "body"),
        (COMPLETIONS, b"not json", 400, "JSON"),
        (COMPLETIONS, {"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
        (MESSAGES, {"model": MODEL, "messages": USER}, 400, "max_tokens"),
        (MESSAGES, {"model": MODEL, "messages": USER, "max_tokens": 10**6}, 400, "maximum context"),
        (MESSAGES, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}],
                    "max_tokens": 2}, 400, "text only"),
        (MESSAGES, {"model": "claude-9", "messages": USER, "max_tokens": 2}, 404, "does not exist"),
        (MESSAGES, b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_that_says_what_to_change(live, path, content, status, hint):
    base, _ = live
    if isinstance(content, bytes):
        r = httpx.post(
            base + path, content=content, headers={"content-type": "application/json"}, timeout=30
        )
    else:
        r = httpx.post(base + path, json=content, timeout=30)
    check_response(r.status_code, r.content, path, path == MESSAGES)
    assert r.status_code == status, r.text
    assert hint.lower() in r.json()["error"]["message"].lower(), r.text
