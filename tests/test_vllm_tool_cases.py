"""vLLM's structured-output and tool-calling test cases, restated against a live server, and the
field tables of docs/api-fields.md sent field by field.

Restated (the cases, not vLLM's code): guided json/regex/choice/grammar and response_format;
tool_choice required and named, with and without parameters; max_tokens cutting a forced call;
parallel calls streamed and not; prefix caching with tools; request validation. Differences from
vLLM that docs/tool-calling.md documents: forced calls use the template's hermes form (not a
JSON array), and a streamed forced call comes whole (name, then all its arguments) once complete.
One server (built-in random-weight model, ``--tool-call-parser hermes``), seeded sampling.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from servers import MODEL, launch_server
from tool_schemas import ADD, city_schema, weather_and_add_tools

from prefixserve.api.openai.field_support import refused_fields

CITY = city_schema(10)
TOOLS = [
    *weather_and_add_tools(CITY),
    {"type": "function", "function": {"name": "now", "description": "The time; no arguments."}},
]
SCHEMAS = {"get_weather": CITY, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    with launch_server("--tool-call-parser", "hermes", "--allow-client-chat-template") as base:
        yield base


def chat(server: str, **body) -> dict:
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, **body}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server: str, **body) -> list[dict]:
    payload = {"model": MODEL, "messages": USER, "stream": True, **body}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def streamed_message(chunks: list[dict], index: int = 0) -> dict:
    """A choice's content, tool calls (accumulated as OpenAI clients do) and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            assert len(delta.get("tool_calls") or []) <= 1, "one tool-call entry per chunk"
            content += delta.get("content") or ""
            for entry in delta.get("tool_calls") or []:
                call = calls.setdefault(entry["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or entry.get("id")
                call["name"] += entry["function"].get("name") or ""
                call["arguments"] += entry["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    ordered = [calls[i] for i in sorted(calls)]
    assert list(sorted(calls)) == list(range(len(calls)))
    return {"content": content, "calls": [(c["name"], c["arguments"]) for c in ordered],
            "ids": [c["id"] for c in ordered], "finish_reason": finish}  # fmt: skip


def calls_of(choice: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]]  # fmt: skip


def check_arguments(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        if name == "now":
            assert arguments == "{}"
        else:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- structured outputs (vLLM's guided_* and response_format cases) ---------------------------


@pytest.mark.parametrize(
    "body, check",
    [
        ({"guided_json": CITY}, lambda t: jsonschema.validate(json.loads(t), CITY)),
        (
            {"structured_outputs": {"json": CITY}},
            lambda t: jsonschema.validate(json.loads(t), CITY),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": CITY},
                }
            },
            lambda t: jsonschema.validate(json.loads(t), CITY),
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {
                "guided_regex": r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
            },
            lambda t: re.fullmatch(r"(\d{1,3}\.){3}\d{1,3}", t),
        ),
        ({"guided_choice": ["Python", "Java", "C"]}, lambda t: t in ("Python", "Java", "C")),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda t: re.fullmatch("[a-c]{4}", t)),
        (
            {"structured_outputs": {"grammar": 'root ::= "<" [0-9]+ ">"'}},
            lambda t: re.fullmatch("<[0-9]+>", t),
        ),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        (
            {
                "structured_outputs": {
                    "structural_tag": json.dumps(
                        {
                            "format": {
                                "type": "tag",
                                "begin": "<w>",
                                "end": "</w>",
                                "content": {"type": "json_schema", "json_schema": CITY},
                            }
                        }
                    )
                }
            },
            lambda t: (
                (t[:3], t[-4:]) == ("<w>", "</w>")
                and jsonschema.validate(json.loads(t[3:-4]), CITY)
            ),
        ),
        (
            {
                "guided_grammar": 'root ::= "SELECT " col " FROM " tbl\ncol ::= "a" | "b"\n'
                'tbl ::= "t" [0-9]'
            },
            lambda t: re.fullmatch(r"SELECT [ab] FROM t[0-9]", t),
        ),
    ],
)
def test_guided_outputs_match_their_constraint(server, body, check):  # fmt: skip
    out = chat(server, max_tokens=120, temperature=1.0, seed=3, n=2, **body)
    for choice in out["choices"]:
        text = choice["message"]["content"]
        if "json_object" in json.dumps(body) and choice["finish_reason"] == "length":
            assert text.startswith("{")  # any keys: a random model may write on
            continue
        assert choice["finish_reason"] == "stop", choice
        assert check(text) is not False


def test_guided_choice_with_logprobs(server):
    out = chat(server, max_tokens=10, logprobs=True, top_logprobs=3,
               guided_choice=["yes", "no"])  # fmt: skip
    choice = out["choices"][0]
    assert choice["message"]["content"] in ("yes", "no")
    for entry in choice["logprobs"]["content"]:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3


def test_structural_tag_response_format_both_shapes(server):
    legacy = {"type": "structural_tag", "triggers": ["<"],
              "structures": [{"begin": "<w>", "schema": CITY, "end": "</w>"}]}  # fmt: skip
    lt = httpx.post(f"{server}/tokenize", json={"prompt": "<"}).json()["tokens"][-1]
    out = chat(
        server,
        max_tokens=80,
        temperature=1.0,
        seed=2,
        response_format=legacy,
        logit_bias={str(lt): 20},
    )  # fmt: skip  (the trigger comes early)
    text = out["choices"][0]["message"]["content"]
    bodies = re.findall(r"<w>(.*?)</w>", text)
    assert bodies, text
    for body in bodies:
        jsonschema.validate(json.loads(body), CITY)
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<w>", "end": "</w>",
        "content": {"type": "json_schema", "json_schema": CITY}}}  # fmt: skip
    text = chat(server, max_tokens=80, temperature=1.0, seed=2, response_format=tag)
    match = re.fullmatch(r"<w>(.*)</w>", text["choices"][0]["message"]["content"], re.DOTALL)
    assert match and jsonschema.validate(json.loads(match.group(1)), CITY) is None


# ---- forced tool calls ----------------------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_calls_streamed_equal_non_streamed(server, choice, seed):
    body = dict(tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=1.0, seed=seed)
    whole = chat(server, **body)["choices"][0]
    streamed = streamed_message(chat_stream(server, **body))
    assert calls_of(whole) and streamed["calls"] == calls_of(whole)
    check_arguments(calls_of(whole))
    assert whole["message"]["content"] is None and streamed["content"] == ""
    assert streamed["finish_reason"] == whole["finish_reason"]
    assert whole["finish_reason"] == ("tool_calls" if choice == "required" else "stop")
    assert all(streamed["ids"]) and len(set(streamed["ids"])) == len(streamed["ids"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "now"}}])
@pytest.mark.parametrize("parameters", [None, {}])
def test_a_tool_without_parameters_is_called_with_empty_arguments(server, choice, parameters):
    function = {"name": "now"} if parameters is None else {"name": "now", "parameters": {}}
    tools = [{"type": "function", "function": function}]
    for seed in range(3):
        whole = chat(server, tools=tools, tool_choice=choice, max_tokens=60, temperature=1.0,
                     seed=seed, parallel_tool_calls=False)["choices"][0]  # fmt: skip
        assert calls_of(whole) == [("now", "{}")] and whole["finish_reason"] != "length"


@pytest.mark.parametrize("choice", ["required", NAMED])
@pytest.mark.parametrize("max_tokens", [1, 4, 9, 16])
def test_max_tokens_cutting_a_forced_call_gives_no_call_and_no_content(server, choice, max_tokens):
    body = dict(tools=TOOLS, tool_choice=choice, max_tokens=max_tokens, temperature=1.0, seed=4,
                parallel_tool_calls=False)  # fmt: skip
    whole = chat(server, **body)["choices"][0]
    streamed = streamed_message(chat_stream(server, **body))
    if max_tokens <= 9:  # shorter than any call
        assert whole["finish_reason"] == "length"
    if whole["finish_reason"] == "length":
        assert whole["message"]["content"] is None and whole["message"]["tool_calls"] == []
    assert streamed["calls"] == calls_of(whole) and streamed["content"] == ""
    assert streamed["finish_reason"] == whole["finish_reason"]


def _parallel_reply(server: str) -> tuple[dict, dict]:
    """(request body, reply) of a seeded required call that made two calls or more."""
    for seed in range(12):
        body = dict(tools=TOOLS, tool_choice="required", max_tokens=400, temperature=1.0,
                    seed=seed)  # fmt: skip
        reply = chat(server, **body)
        if len(calls_of(reply["choices"][0])) >= 2:
            return body, reply
    pytest.fail("no seed gave parallel calls")


def test_max_tokens_keeps_the_complete_calls_before_the_cut_one(server):
    body, reply = _parallel_reply(server)
    calls = calls_of(reply["choices"][0])
    # The last call ends "}\n</tool_call>" then EOS: three tokens fewer cut it.
    cut = {**body, "max_tokens": reply["usage"]["completion_tokens"] - 3}
    part = chat(server, **cut)["choices"][0]
    assert part["finish_reason"] == "length" and part["message"]["content"] is None
    assert calls_of(part) == calls[:-1]
    streamed = streamed_message(chat_stream(server, **cut))
    assert streamed["calls"] == calls[:-1] and streamed["content"] == ""
    one = chat(server, **body, parallel_tool_calls=False)["choices"][0]
    assert len(calls_of(one)) == 1


def test_parallel_calls_streamed_one_entry_per_chunk(server):
    body, reply = _parallel_reply(server)
    streamed = streamed_message(chat_stream(server, **body))  # asserts one entry per chunk
    assert streamed["calls"] == calls_of(reply["choices"][0])
    assert streamed["finish_reason"] == reply["choices"][0]["finish_reason"] == "tool_calls"


# ---- auto (hermes) ---------------------------------------------------------------------------

TWO_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_calls_each_in_its_own_chunk_and_parallel_tool_calls_false(server, parallel):
    # The random model is made to write two hermes calls by a grammar (allowed with "auto").
    body = dict(tools=TOOLS, tool_choice="auto", max_tokens=200, parallel_tool_calls=parallel,
                guided_grammar=f"root ::= {json.dumps(TWO_CALLS)}")  # fmt: skip
    whole = chat(server, **body)["choices"][0]
    expected = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Rome", "days": 2}')]
    expected = expected if parallel else expected[:1]
    assert calls_of(whole) == expected and whole["message"]["content"] is None
    assert whole["finish_reason"] == "tool_calls"
    streamed = streamed_message(chat_stream(server, **body))
    assert streamed["calls"] == expected and streamed["finish_reason"] == "tool_calls"


# ---- prefix caching with tools ---------------------------------------------------------------


def test_prefix_caching_with_tools(server):
    body = dict(tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, seed=9)
    chat(server, **body)
    again = chat(server, **body)
    usage = again["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert (usage["prompt_tokens"] - 1) // 16 * 16 <= cached <= usage["prompt_tokens"]


# ---- request validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": []}, "tools"),
        ({"tools": [], "tool_choice": "auto"}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": NAMED}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
          "tool_choice": "required"}, "tools"),
        ({"guided_json": 12}, "guided_json"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "structural_tag", "structures": []}}, "response_format"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.8}, "temperature"),
        ({"use_beam_search": True, "n": 2, "top_p": 0.5}, "top_p"),
    ],
)  # fmt: skip
def test_requests_vllm_refuses_are_400s(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions",
                   json={"model": MODEL, "messages": USER, "max_tokens": 4, **body})  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_choice_none_without_tools_is_plain_chat(server):
    assert chat(server, tool_choice="none", max_tokens=3)["choices"][0]["message"]["content"]


# ---- beam search --------------------------------------------------------------------------------


def test_beam_search_honours_stop_over_http(server):
    body = {"prompt": "beam me up", "max_tokens": 12, "use_beam_search": True, "n": 2,
            "ignore_eos": True}  # fmt: skip
    free = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}).json()
    text = free["choices"][0]["text"]
    stop = text[len(text) // 2 :][:2]
    out = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body, "stop": [stop],
                                                       "seed": 1}).json()  # fmt: skip
    assert all(stop not in c["text"] for c in out["choices"])
    assert any(c["stop_reason"] == stop and c["finish_reason"] == "stop" for c in out["choices"])
    kept = httpx.post(f"{server}/v1/completions", json={
        "model": MODEL, **body, "stop": [stop], "include_stop_str_in_output": True}).json()  # fmt: skip
    ended = [c["text"] for c in kept["choices"] if c["stop_reason"] == stop]
    assert ended and all(t.endswith(stop) and t.count(stop) == 1 for t in ended)


@pytest.mark.parametrize("skip, texts", [(True, {"ab"}),
                                         (False, {"ab<|end_of_text|>", "ab<|im_end|>"})])  # fmt: skip
def test_beam_search_honours_skip_special_tokens(server, skip, texts):
    body = {"prompt": "x", "max_tokens": 8, "use_beam_search": True, "n": 1,
            "guided_grammar": 'root ::= "ab"', "skip_special_tokens": skip}  # fmt: skip
    out = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}).json()
    assert out["choices"][0]["text"] in texts  # the EOS that ended the beam, or not


# ---- every field of docs/api-fields.md's table and list is sent ---------------------------------

REFUSING = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "extreme",
    "verbosity": "low",
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "store": True,
    "service_tier": "flex",
    "suffix": "tail",
    "prompt_embeds": "AAAA",
    "best_of": 3,
    "logits_processors": ["x"],
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " *",
    "priority": 3,
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"k": 1},
    "spaces_between_special_tokens": False,
    "mm_processor_kwargs": {"k": 1},
}
_COMPLETIONS_ONLY = {"suffix", "prompt_embeds"}


def test_every_refused_field_has_a_case():
    assert set(REFUSING) == set(refused_fields())


@pytest.mark.parametrize("field", sorted(REFUSING))
def test_each_refused_field_is_a_400_naming_it(server, field):
    path, base = ("completions", {"prompt": "x"}) if field in _COMPLETIONS_ONLY else (
        "chat/completions", {"messages": USER})  # fmt: skip
    r = httpx.post(f"{server}/v1/{path}",
                   json={"model": MODEL, "max_tokens": 2, **base, field: REFUSING[field]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def _ids(out: dict) -> list[int]:
    return out["choices"][0]["token_ids"]


def test_honoured_fields_change_the_result(server):
    """One request per row of the API-fields table (docs/api-fields.md), each checked for its
    effect."""
    greedy = {"max_tokens": 6, "temperature": 0, "return_token_ids": True}
    base = chat(server, **greedy)
    base_ids, prompt_ids = _ids(base), base["prompt_token_ids"]

    def comp(**body) -> dict:
        r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    pl = comp(prompt="hello there", max_tokens=1, prompt_logprobs=2)["choices"][0]
    assert pl["prompt_logprobs"][0] is None and len(pl["prompt_logprobs"][1]) >= 2
    echo = comp(prompt="hello there", max_tokens=2, echo=True, logprobs=1)["choices"][0]
    assert echo["text"].startswith("hello there") and echo["logprobs"]["token_logprobs"][0] is None
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    cont = chat(server, messages=turn, echo=True, add_generation_prompt=False,
                continue_final_message=True, max_tokens=3)  # fmt: skip
    assert cont["choices"][0]["message"]["content"].startswith("Once")
    biased = chat(server, **greedy, logit_bias={"77": 100})
    assert set(_ids(biased)) == {77}
    allowed = chat(server, **greedy, allowed_token_ids=[80, 81])
    assert set(_ids(allowed)) <= {80, 81}
    [hello] = httpx.post(f"{server}/tokenize", json={"prompt": "hello",
                         "add_special_tokens": False}).json()["tokens"]  # fmt: skip
    pushed = chat(server, **greedy, logit_bias={str(hello): 100})
    banned = chat(server, **greedy, logit_bias={str(hello): 100}, bad_words=["hello"])
    assert hello in _ids(pushed) and hello not in _ids(banned)
    parts = chat(server, **greedy, messages=[{"role": "user", "content": [
        {"type": "text", "text": USER[0]["content"]}]}])  # fmt: skip
    assert _ids(parts) == base_ids
    no_gen = chat(server, **greedy, add_generation_prompt=False)
    assert len(no_gen["prompt_token_ids"]) < len(prompt_ids)
    special = chat(server, **greedy, add_special_tokens=True)
    assert special["prompt_token_ids"] != prompt_ids
    template = (
        "{% for d in documents %}[{{ d.text }}]{% endfor %}{{ flavor }}:{{ messages[-1].content }}"
    )
    docs = chat(server, **greedy, chat_template=template, chat_template_kwargs={"flavor": "mint"},
                documents=[{"title": "t", "text": "DOC"}])  # fmt: skip
    rendered = httpx.post(f"{server}/detokenize",
                          json={"tokens": docs["prompt_token_ids"]}).json()["prompt"]  # fmt: skip
    assert rendered == f"[DOC]mint:{USER[0]['content']}"
    truncated = comp(prompt=list(range(100, 140)), max_tokens=1, truncate_prompt_tokens=7)
    assert truncated["usage"]["prompt_tokens"] == 7
    as_ids = chat(server, **greedy, logprobs=True, return_tokens_as_token_ids=True)
    assert as_ids["choices"][0]["logprobs"]["content"][0]["token"] == f"token_id:{base_ids[0]}"
    stop_id = base_ids[2]
    stopped = chat(server, **greedy, stop_token_ids=[stop_id])["choices"][0]
    assert stopped["stop_reason"] == stop_id and stopped["token_ids"][-1] == stop_id
    named = chat(server, max_tokens=1, request_id="my-req-7")
    assert named["id"] == "chatcmpl-my-req-7"
    strs = httpx.post(f"{server}/tokenize", json={"prompt": "hello", "return_token_strs": True})
    assert strs.json()["token_strs"][-1] == "hello"


@pytest.mark.parametrize("include", [True, False])
def test_continuous_usage_stats_only_with_include_usage(server, include):
    chunks = chat_stream(server, max_tokens=4, stream_options={
        "include_usage": include, "continuous_usage_stats": True})  # fmt: skip
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == (len(chunks) if include else 0)
