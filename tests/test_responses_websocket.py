"""Responses over WebSocket against a live server: a warm-up, continuations that carry only
their new items with ``store: false`` (kept in the connection's chain, spliced token-exact),
errors as events on a connection that stays open, and the API key."""

from __future__ import annotations

import json

import httpx
import pytest
from servers import MODEL, launch_server, metric, scrape
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

BLOCK = 16
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"], "additionalProperties": False}}]  # fmt: skip
COMMON = {"type": "response.create", "model": MODEL, "instructions": "You help with weather.",
          "tools": TOOLS, "store": False, "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with launch_server("--tool-call-parser", "hermes") as base:
        yield base


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/responses"


def send(ws, **frame) -> list[dict]:
    """One frame's events, up to its terminal one."""
    ws.send(json.dumps({**COMMON, **frame}))
    events = []
    while True:
        events.append(json.loads(ws.recv(timeout=60)))
        if events[-1]["type"] in ("response.completed", "response.incomplete",
                                  "response.failed", "error"):  # fmt: skip
            return events


def exact(base: str) -> float:
    return metric(scrape(base), "prefixserve_responses_continuations_total", kind="token_exact")


def test_warmup_then_token_exact_continuations_in_the_connection(server):
    before = exact(server)
    with connect(ws_url(server)) as ws:
        warm = send(ws, input=[], generate=False)
        assert [e["type"] for e in warm] == ["response.created", "response.in_progress",
                                             "response.completed"]  # fmt: skip
        assert [e["sequence_number"] for e in warm] == [0, 1, 2]
        warmed = warm[-1]["response"]
        assert warmed["output"] == [] and warmed["usage"]["output_tokens"] == 0
        ask = send(ws, previous_response_id=warmed["id"], tool_choice="required", temperature=0,
                   input=[{"role": "user", "content": "Weather in Paris?"}])  # fmt: skip
        asked = ask[-1]["response"]
        assert ask[-1]["type"] == "response.completed"
        cached = asked["usage"]["input_tokens_details"]["cached_tokens"]
        assert cached >= warmed["usage"]["input_tokens"] // BLOCK * BLOCK > 0
        (call,) = asked["output"]
        result = send(ws, previous_response_id=asked["id"], max_output_tokens=4, temperature=0,
                      input=[{"type": "function_call_output", "call_id": call["call_id"],
                              "output": "sunny"}])  # fmt: skip
        done = result[-1]["response"]
        previous = asked["usage"]["input_tokens"] + asked["usage"]["output_tokens"] - 1
        assert done["usage"]["input_tokens_details"]["cached_tokens"] >= previous // BLOCK * BLOCK
    assert exact(server) - before == 2
    # store: false kept them in the connection only
    assert httpx.get(f"{server}/v1/responses/{asked['id']}").status_code == 404


def test_errors_are_events_and_the_connection_stays_open(server):
    with connect(ws_url(server)) as ws:
        (missing,) = send(ws, previous_response_id="resp_nope", input="hi")
        assert missing["type"] == "error" and missing["status"] == 404
        assert missing["error"]["param"] == "previous_response_id"
        ws.send("not json")
        bad = json.loads(ws.recv(timeout=10))
        assert bad["type"] == "error" and bad["status"] == 400
        (refused,) = send(ws, input="hi", background=True)
        assert refused["error"]["param"] == "background"
        ok = send(ws, input="hi", max_output_tokens=2)
        assert ok[-1]["type"] == "response.incomplete"


def test_websocket_requires_the_api_key_and_bounds_frames():
    with launch_server("--api-key", "secret", "--max-request-body-bytes", "4096") as base:
        with pytest.raises(InvalidStatus):
            connect(ws_url(base)).close()
        with connect(ws_url(base), additional_headers={"Authorization": "Bearer secret"}) as ws:
            assert send(ws, input="hi", max_output_tokens=1, tools=None)[-1]["response"]["id"]
            (big,) = send(ws, input="x" * 5000)
            assert big["type"] == "error" and big["status"] == 413


def test_every_failing_frame_is_one_error_event(server):
    """Issue 30: a binary frame, or an error that was no ``APIError`` (a string reasoning
    ``summary`` was a TypeError), closed the connection with 1011."""
    with connect(ws_url(server)) as ws:
        ws.send(b'{"type": "response.create"}')
        binary = json.loads(ws.recv(timeout=10))
        assert binary["type"] == "error" and binary["status"] == 400
        (bad,) = send(ws, input=[{"type": "reasoning", "summary": 3}])
        assert bad["status"] == 400 and bad["error"]["param"] == "input"
        fine = send(ws, input=[{"role": "user", "content": "hi"},
                               {"type": "reasoning", "summary": "plan"}], max_output_tokens=2)  # fmt: skip
        assert fine[-1]["type"] in ("response.completed", "response.incomplete")


def test_drain_waits_for_a_websocket_turn_and_refuses_new_upgrades():
    import signal
    import time

    from servers import server_process

    long_text = {"format": {"type": "json_schema", "name": "long", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 400}},
        "required": ["a"]}}}  # fmt: skip
    with server_process("--shutdown-grace-seconds", "30") as (proc, base):
        with connect(ws_url(base)) as ws:
            ws.send(json.dumps({**COMMON, "tools": None, "input": "go", "text": long_text,
                                "max_output_tokens": 600}))  # fmt: skip
            events = [json.loads(ws.recv(timeout=60)) for _ in range(4)]  # the turn is running
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.5)
            with pytest.raises((InvalidStatus, OSError)):
                connect(ws_url(base), open_timeout=5).close()
            while events[-1]["type"] not in ("response.completed", "response.incomplete",
                                             "response.failed", "error"):  # fmt: skip
                events.append(json.loads(ws.recv(timeout=60)))
            finished = time.monotonic()
        assert events[-1]["type"] == "response.completed", events[-1]  # not cut off
        assert finished - signalled > 0.5  # it ran on while the server drained
        assert proc.wait(timeout=30) == 0
