"""``--reasoning-parser`` end to end: real ``prefixserve serve`` processes of tiny random
checkpoints carrying DeepSeek-R1's and Qwen3's real chat templates, driven by the ``openai``
client. ``logit_bias`` on ``</think>`` makes the random model end its reasoning soon. Chat's
``reasoning_effort`` switches Qwen3's thinking (``frontend/reasoning_effort.py``)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from families import family_checkpoint, family_tokenizer
from servers import server_process

from prefixserve.api.frontend.reasoning_effort import EFFORTS, effort_kwargs

USER = [{"role": "user", "content": "Is 7 prime?"}]
ANSWER = {
    "type": "object",
    "properties": {"prime": {"type": "boolean"}, "n": {"enum": [7]}},
    "required": ["prime", "n"],
}
PICK = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": PICK}}]


def _serve(family: str, tmp_path_factory, *extra: str):
    folder = family_checkpoint(family, tmp_path_factory.mktemp(family))
    end = family_tokenizer(family).convert_tokens_to_ids("</think>")
    args = ("--model", str(folder), "--served-model-name", "m", "--reasoning-parser", family,
            "--max-model-len", "4096", *extra)  # fmt: skip
    return server_process(*args), {str(end): 6.0}


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    context, bias = _serve("deepseek_r1", tmp_path_factory)
    with context as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), bias


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    context, bias = _serve("qwen3", tmp_path_factory, "--tool-call-parser", "hermes")
    with context as (_, base):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), bias


def _stream(client, **kwargs) -> tuple[str, str, list, dict]:
    """(reasoning, content, [(name, arguments)], usage) of a streamed request."""
    reasoning = content = ""
    calls: dict[int, dict] = {}
    usage = None
    for chunk in client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    listed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return reasoning, content, listed, usage


@pytest.mark.parametrize("seed", [1, 2])
def test_r1_reasoning_is_split_streamed_as_whole_and_counted(r1, seed):
    client, bias = r1
    kwargs = dict(model="m", messages=USER, max_tokens=40, temperature=1.0, seed=seed,
                  logit_bias=bias)  # fmt: skip
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    message, ids = whole.choices[0].message, whole.choices[0].token_ids
    end = int(next(iter(bias)))
    assert end in ids  # the bias worked: the reasoning closed
    assert message.reasoning_content is not None and "</think>" not in message.reasoning_content
    assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(end) + 1
    reasoning, content, _, usage = _stream(client, **kwargs)
    assert reasoning == message.reasoning_content
    assert (content or None) == message.content
    assert usage.completion_tokens_details.reasoning_tokens == ids.index(end) + 1


def test_r1_json_schema_applies_after_the_reasoning(r1):
    client, bias = r1
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for seed in (3, 4):
        kwargs = dict(model="m", messages=USER, max_tokens=60, temperature=1.0, seed=seed,
                      logit_bias=bias, response_format=fmt)  # fmt: skip
        message = client.chat.completions.create(**kwargs).choices[0].message
        assert message.reasoning_content is not None
        jsonschema.validate(json.loads(message.content), ANSWER)


def test_qwen3_forced_call_comes_after_the_reasoning(qwen3):
    client, bias = qwen3
    kwargs = dict(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=5,
                  logit_bias=bias)  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert whole.finish_reason == "tool_calls" and calls[0][0] == "pick"
    assert whole.message.reasoning_content is not None and whole.message.content is None
    reasoning, content, streamed_calls, usage = _stream(client, **kwargs)
    assert (reasoning, content, streamed_calls) == (whole.message.reasoning_content, "", calls)
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_qwen3_thinking_off_has_no_reasoning(qwen3):
    client, _ = qwen3
    first = client.chat.completions.create(
        model="m", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=60,
        parallel_tool_calls=False, temperature=1.0, seed=6,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.message.reasoning_content is None and choice.message.tool_calls
    assert first.usage.completion_tokens_details.reasoning_tokens == 0


def test_effort_sets_the_thinking_switch_only_where_the_template_has_it():
    assert effort_kwargs(None, "no switch") == {} == effort_kwargs(None, None)
    assert effort_kwargs("high", "{{ messages }}") is None  # ignored, and named in a header
    switch = "{% if enable_thinking is defined %}{% endif %}"
    assert [effort_kwargs(e, switch)["enable_thinking"] for e in EFFORTS] == [
        False, False, True, True, True, True]  # fmt: skip


def test_chat_reasoning_effort_switches_thinking_where_the_template_can(qwen3, r1):
    """Issue 30: chat's ``reasoning_effort`` was a 400; it takes Responses' path: Qwen3's
    template renders it as ``enable_thinking`` (the request's own kwarg wins), DeepSeek-R1's has
    no switch, so it is ignored and named in ``x-prefixserve-ignored``, streamed or not."""
    client, _ = qwen3
    kwargs = dict(model="m", messages=USER, max_tokens=1, extra_body={"return_token_ids": True})

    def prompt(**extra) -> list[int]:
        raw = client.chat.completions.with_raw_response.create(**kwargs, **extra)
        assert "x-prefixserve-ignored" not in raw.headers
        return raw.parse().prompt_token_ids

    plain, on, off = prompt(), prompt(reasoning_effort="high"), prompt(reasoning_effort="minimal")
    assert on == plain and off[: len(plain)] == plain and len(off) > len(plain)
    assert prompt(reasoning_effort="none") == off
    kept = dict(kwargs, extra_body={**kwargs["extra_body"],
                                    "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    assert client.chat.completions.create(**kept, reasoning_effort="none").prompt_token_ids == plain
    r1_client, _ = r1
    for stream in (False, True):
        raw = r1_client.chat.completions.with_raw_response.create(
            model="m", messages=USER, max_tokens=1, reasoning_effort="low", stream=stream
        )
        assert raw.status_code == 200 and raw.headers["x-prefixserve-ignored"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as err:
        r1_client.chat.completions.create(model="m", messages=USER, reasoning_effort="extreme")
    assert err.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("seed", [1, 2])
def test_r1_responses_reasoning_item_streamed_as_whole_and_counted(r1, seed):
    """Responses: the reasoning is a ``reasoning`` item before any message, its events in
    OpenAI's order through the SDK's own stream, and its tokens counted in usage."""
    client, _ = r1
    kwargs = dict(model="m", input="Is 7 prime?", max_output_tokens=24, temperature=1.0,
                  extra_body={"seed": seed})  # fmt: skip
    whole = client.responses.create(**kwargs)
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [p.type for p in reasoning.content] == ["reasoning_text"] and reasoning.content[0].text
    assert [i.type for i in whole.output[1:]] in ([], ["message"])
    details = whole.usage.output_tokens_details
    if len(whole.output) == 1:  # the reasoning never closed: every token is reasoning
        assert details.reasoning_tokens == whole.usage.output_tokens
    else:
        assert 0 < details.reasoning_tokens < whole.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    final = events[-1].response  # completed, or incomplete at max_output_tokens
    assert events[-1].type == f"response.{whole.status}"
    assert final.output[0].content[0].text == reasoning.content[0].text
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    mine = [e.type for e in events if getattr(e, "output_index", None) == 0]
    assert mine[:2] == ["response.output_item.added", "response.content_part.added"]
    assert set(mine[2:-3]) == {"response.reasoning_text.delta"}
    assert mine[-3:] == ["response.reasoning_text.done", "response.content_part.done",
                         "response.output_item.done"]  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text


def test_r1_responses_continue_after_reasoning(r1):
    """A continued response's reasoning item goes back in as the assistant's reasoning, which
    R1's template drops from earlier turns: the continuation is re-rendered, and counted."""
    client, _ = r1
    base = str(client.base_url).removesuffix("/v1/")
    first = client.responses.create(model="m", input="Is 7 prime?", max_output_tokens=8,
                                    temperature=0.0)  # fmt: skip
    assert first.output[0].type == "reasoning"
    before = httpx.get(f"{base}/stats").json()
    second = client.responses.create(model="m", previous_response_id=first.id, input="And 9?",
                                     max_output_tokens=4, temperature=0.0)  # fmt: skip
    after = httpx.get(f"{base}/stats").json()
    assert second.output[0].type == "reasoning"
    kinds = ("responses_continuations_token_exact", "responses_continuations_rerendered")
    assert sum(after[k] - before[k] for k in kinds) == 1


def test_qwen3_responses_grammars_compile_after_the_reasoning(qwen3):
    """Responses with a reasoning parser: a strict tool under ``auto`` and a forced call are
    grammars that start after the reasoning block (Qwen3 opens ``<think>`` itself here)."""
    client, _ = qwen3
    tools = [{"type": "function", "name": "pick", "parameters": PICK, "strict": True}]
    for choice in ("auto", "required"):
        r = client.responses.create(model="m", input="Is 7 prime?", tools=tools,
                                    tool_choice=choice, max_output_tokens=12, temperature=1.0,
                                    extra_body={"seed": 3})  # fmt: skip
        assert r.output and r.output[0].type == "reasoning"  # the grammar opened the block
        assert r.usage.output_tokens_details.reasoning_tokens > 0
