"""The load client's retry (``benchmarks/http_load.stream_completion``): a server that closes a
connection before answering is asked again, a reply cut after it began is not."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.aio import run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import http_load

REPLY = b'data: {"choices": [{"text": "hi"}]}\n\ndata: [DONE]\n\n'


class _Server:
    """A transport that drops the first ``drops`` requests without a response, then answers
    with ``reply()``."""

    def __init__(self, drops: int, reply=lambda: httpx.Response(200, content=REPLY)) -> None:
        self.drops, self.reply, self.calls = drops, reply, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls <= self.drops:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return self.reply()


async def _complete(server) -> http_load.Turn:
    turn = http_load.Turn(0, 0, "prompt")
    transport = httpx.MockTransport(server)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        await http_load.stream_completion(client, "m", turn, 4)
    return turn


@run
async def test_a_connection_dropped_before_the_answer_is_retried():
    server = _Server(drops=http_load.MAX_RETRIES)
    turn = await _complete(server)
    assert (turn.text, turn.retries, server.calls) == ("hi", 2, 3)


@run
async def test_retries_stop_at_the_limit():
    with pytest.raises(httpx.RemoteProtocolError):
        await _complete(_Server(drops=http_load.MAX_RETRIES + 1))


class _CutStream(httpx.AsyncByteStream):
    """One chunk of a reply, then the connection closes."""

    async def __aiter__(self):
        yield b'data: {"choices": [{"text": "hi"}]}\n\n'
        raise httpx.RemoteProtocolError("peer closed connection")


@run
async def test_a_reply_cut_after_it_began_is_not_retried():
    server = _Server(drops=0, reply=lambda: httpx.Response(200, stream=_CutStream()))
    with pytest.raises(httpx.RemoteProtocolError):
        await _complete(server)
    assert server.calls == 1
