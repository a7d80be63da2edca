"""``Generation`` and ``EngineClient.generate``: one stream of a request's engine requests, DELTA
outputs that arrived together read as one, errors after what came before them, silence as None,
and every request not finished aborted when the generation closes or an add is refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from prefixserve.api.engine_client import (
    EngineClient,
    EngineOverloadedError,
    RequestStream,
    RequestTimeoutError,
)
from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sampling_params import RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA


class Client(EngineClient):
    """Adds requests whose streams the test feeds; refuses the ``refuse``-th add."""

    def __init__(self, refuse: int | None = None, queue_full: bool = False) -> None:
        self.streams: list[RequestStream] = []
        self.aborted: list[str] = []
        self.refuse, self.queue_full = refuse, queue_full

    def admit(self, count: int) -> None:
        if self.queue_full:
            raise EngineOverloadedError("the queue is full")

    async def add(self, request_id, prepared, *, timeout=None, routing_key=None) -> RequestStream:
        if len(self.streams) == self.refuse:
            raise APIError("refused", 400)
        stream = RequestStream.create(request_id, timeout, prepared.params.output_kind)
        stream.settle_accepted(None)
        self.streams.append(stream)
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def out(rid: str, text: str, finished: bool = False) -> RequestOutput:
    c = CompletionOutput(0, text, [len(text)], finish_reason="stop" if finished else None)
    return RequestOutput(rid, None, [1, 2], [c], finished)


def params(kind: RequestOutputKind = DELTA) -> SimpleNamespace:
    """A prepared request's stand-in: what ``add`` reads of it."""
    return SimpleNamespace(params=SamplingParams(output_kind=kind))


def test_outputs_of_every_request_come_tagged_with_their_prompt():
    async def main():
        client = Client()
        generation = await client.generate("r", [params(), params()])
        a, b = client.streams
        b.queue.put_nowait(out("r-1", "x", finished=True))
        a.queue.put_nowait(out("r-0", "y", finished=True))
        async with generation:
            got = [(i, o.outputs[0].text) async for i, o in generation]
        return got, client.aborted

    got, aborted = asyncio.run(main())
    assert sorted(got) == [(0, "y"), (1, "x")] and aborted == []


def test_deltas_queued_together_read_as_one():
    async def main():
        client = Client()
        generation = await client.generate("r", [params()])
        (stream,) = client.streams
        for piece in ("a", "b", "c"):
            stream.queue.put_nowait(out("r-0", piece))
        stream.queue.put_nowait(out("r-0", "d", finished=True))
        async with generation:
            return [o async for _, o in generation]

    (whole,) = asyncio.run(main())
    assert whole.outputs[0].text == "abcd" and whole.outputs[0].token_ids == [1, 1, 1, 1]
    assert whole.finished and whole.outputs[0].finish_reason == "stop"


def test_an_error_comes_after_the_outputs_before_it_and_closing_aborts_the_rest():
    async def main():
        client = Client()
        generation = await client.generate("r", [params(), params()])
        a = client.streams[0]
        a.queue.put_nowait(out("r-0", "hi"))
        a.queue.put_nowait(APIError("boom", 500))
        seen = []
        with pytest.raises(APIError, match="boom"):
            async with generation:
                async for _, o in generation:
                    seen.append(o.outputs[0].text)
        return seen, client.aborted

    seen, aborted = asyncio.run(main())
    assert seen == ["hi"] and aborted == ["r-1"]  # r-0 ended with its error


def test_silence_is_none_and_then_the_output():
    async def main():
        client = Client()
        generation = await client.generate("r", [params()])
        assert await generation.next(0.01) is None
        client.streams[0].queue.put_nowait(out("r-0", "late", finished=True))
        got = await generation.next(1.0)
        with pytest.raises(StopAsyncIteration):
            await generation.next(0.01)
        generation.close()
        return got, client.aborted

    (index, output), aborted = asyncio.run(main())
    assert (index, output.outputs[0].text, aborted) == (0, "late", [])


def test_a_refused_add_aborts_those_added_and_a_full_queue_adds_nothing():
    async def main(client):
        with pytest.raises((APIError, EngineOverloadedError)):
            await client.generate("r", [params(), params(), params()])
        return client

    refused = asyncio.run(main(Client(refuse=2)))
    assert refused.aborted == ["r-0", "r-1"]
    full = asyncio.run(main(Client(queue_full=True)))
    assert full.streams == [] and full.aborted == []


def test_one_request_is_read_without_a_pump_task_and_its_error_follows_its_outputs():
    async def main():
        client = Client()
        generation = await client.generate("r", [params()])
        (stream,) = client.streams
        stream.queue.put_nowait(out("r-0", "a"))
        stream.queue.put_nowait(out("r-0", "b"))
        stream.queue.put_nowait(APIError("boom", 500))
        tasks = len(asyncio.all_tasks())
        _, first = await generation.next()
        assert len(asyncio.all_tasks()) == tasks  # no task between the stream and its reader
        with pytest.raises(APIError, match="boom"):
            await generation.next()
        generation.close()
        return first, client.aborted

    first, aborted = asyncio.run(main())
    assert first.outputs[0].text == "ab" and aborted == []  # the error ended the request


def test_one_request_past_its_deadline_is_a_408_and_closing_aborts_it():
    async def main():
        client = Client()
        generation = await client.generate("r", [params()], timeout=0.01)
        with pytest.raises(RequestTimeoutError):
            async with generation:
                async for _ in generation:
                    pass
        return client.aborted

    assert asyncio.run(main()) == ["r-0"]
