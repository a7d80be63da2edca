"""Responses tools as Codex sends them (``api/openai/responses/tools.py``): functions, namespaces,
``custom`` tools as calls of one ``input`` (back as ``custom_tool_call`` items), ``tool_search``
and hosted tools accepted and not offered (a header and a counter), ``reasoning.effort`` and
``text.verbosity`` accepted; over HTTP on scripted output (``scripted_engine``)."""

from __future__ import annotations

import json

import pytest
from scripted_engine import ScriptedEngine, scripted_client

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.openai.responses.items import normalize_input, to_messages
from prefixserve.api.openai.responses.tools import chat_tools
from prefixserve.structured_outputs.json_grammar import EBNF_KEY

PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark",
                    "definition": 'start: "*** Begin Patch" LF\n%import common.LF\n'}}  # fmt: skip
EXEC = {"type": "function", "name": "exec_command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}  # fmt: skip
CODEX_TOOLS = [EXEC, PATCH, {"type": "tool_search", "execution": "client", "parameters": {}},
               {"type": "web_search", "external_web_access": False}]  # fmt: skip


def test_functions_namespaces_and_what_is_not_offered():
    tools = chat_tools([*CODEX_TOOLS, {"type": "namespace", "name": "mcp", "tools": [
        {"type": "function", "name": "spawn", "defer_loading": True}]}])  # fmt: skip
    assert [t["function"]["name"] for t in tools.functions] == ["exec_command", "apply_patch",
                                                                "spawn"]  # fmt: skip
    assert tools.namespaces == {"spawn": "mcp"} and tools.custom == {"apply_patch"}
    assert tools.strict == {"spawn", "apply_patch"}  # a custom tool's grammar constrains it
    assert tools.not_offered == ["tool_search", "web_search"]
    grammar = {t["function"]["name"]: t["function"].get("parameters", {})
               for t in tools.grammar_functions}
    assert EBNF_KEY in grammar["apply_patch"] and EBNF_KEY not in grammar["exec_command"]
    (patch,) = [t["function"] for t in tools.functions if t["function"]["name"] == "apply_patch"]
    assert patch["parameters"]["required"] == ["input"]
    assert "*** Begin Patch" in patch["parameters"]["properties"]["input"]["description"]
    assert chat_tools(None).functions is None


@pytest.mark.parametrize("tools, match", [
    ([{"type": "web_search"}], "hosted tool"),
    ([{"type": "local_shell"}], "'local_shell'"),
    ([EXEC, {**EXEC}], "given twice"),
    ([{"type": "custom", "name": "x", "format": {"type": "regex"}}], "format"),
])  # fmt: skip
def test_refused_tools_name_why(tools, match):
    with pytest.raises(APIError, match=match) as err:
        chat_tools(tools, hosted="refuse")
    assert err.value.status == 400 and err.value.param == "tools"


def test_a_custom_call_renders_as_a_call_of_its_input():
    items = normalize_input([
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** é"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
    ])  # fmt: skip
    assert to_messages(items)[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "apply_patch", "arguments": '{"input": "*** é"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]  # fmt: skip
    with pytest.raises(APIError, match="'input'"):
        normalize_input([{"type": "custom_tool_call", "call_id": "c", "name": "p"}])


CALL = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n"}}\n</tool_call>'


@pytest.mark.parametrize("stream", [False, True])
def test_codex_tools_over_http(stream):
    engine = ScriptedEngine(replies=[[CALL[:20], CALL[20:]]])
    with scripted_client(engine, tool_call_parser="hermes") as client:
        r = client.post("/v1/responses", json={
            "model": "m", "input": "patch it", "tools": CODEX_TOOLS, "stream": stream,
            "reasoning": {"effort": "medium"}, "text": {"verbosity": "low"},
            "include": ["reasoning.encrypted_content"]})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.headers["x-prefixserve-tools-not-offered"] == "tool_search, web_search"
        assert r.headers["x-prefixserve-ignored"] == "reasoning.effort, text.verbosity"
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ")]  # fmt: skip
            kinds = [e["type"] for e in events]
            assert "response.custom_tool_call_input.done" in kinds
            body = events[-1]["response"]
        else:
            body = r.json()
        (item,) = body["output"]
        assert (item["type"], item["name"], item["input"]) == (
            "custom_tool_call", "apply_patch", "*** Begin Patch\n")  # fmt: skip
        assert body["reasoning"] == {"effort": "medium"}
        metrics = client.app.state.responses.tools_not_offered
        assert metrics == {"tool_search": 1, "web_search": 1}
        prompt = engine.tokenizer.decode(engine.requests[0][0])
        assert '"name": "apply_patch"' in prompt and "web_search" not in prompt


def test_hosted_tools_refused_on_request():
    with scripted_client(ScriptedEngine(), hosted_tools="refuse") as client:
        r = client.post("/v1/responses", json={"model": "m", "input": "x",
                                               "tools": [{"type": "web_search"}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_reasoning_effort_switches_thinking_where_the_template_can():
    engine = ScriptedEngine(replies=[["a"], ["b"]])
    engine.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>{% endif %}"
    )
    with scripted_client(engine) as client:
        for effort in ("minimal", "high"):
            r = client.post("/v1/responses", json={"model": "m", "input": "x",
                                                   "reasoning": {"effort": effort}})  # fmt: skip
            assert r.status_code == 200 and "x-prefixserve-ignored" not in r.headers
    off, on = (engine.tokenizer.decode(ids) for ids, _ in engine.requests)
    assert off.endswith("</think>") and not on.endswith("</think>")


def test_a_custom_tools_lark_grammar_constrains_its_calls():
    """Codex's apply_patch grammar, through xgrammar's Lark reader, JSON-escaped: a forced call's
    input must be a patch (``custom_grammar``)."""
    from prefixserve.structured_outputs.manager import StructuredOutputManager

    lark = ('start: "*** Begin Patch" LF hunk+ "*** End Patch" LF?\n'
            'hunk: "*** Add File: " /(.+)/ LF ("+" /(.*)/ LF)+\n%import common.LF\n')  # fmt: skip
    patch = {**PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": lark}}
    engine = ScriptedEngine(replies=[[CALL]])
    with scripted_client(engine, tool_call_parser="hermes") as client:
        r = client.post("/v1/responses", json={"model": "m", "input": "patch it", "tools": [patch],
                        "tool_choice": {"type": "custom", "name": "apply_patch"}})  # fmt: skip
        assert r.status_code == 200, r.text
    tok = engine.tokenizer
    manager = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    params = engine.requests[0][1].structured_outputs

    def accepts(value: str) -> bool:
        grammar = manager.new_grammar(manager.submit(params).result())
        arguments = json.dumps({"input": value}, ensure_ascii=False)
        call = f'<tool_call>\n{{"name": "apply_patch", "arguments": {arguments}}}\n</tool_call>'
        return grammar.matcher.accept_string(call) and grammar.matcher.is_completed()

    assert accepts('*** Begin Patch\n*** Add File: a "b".py\n+print("\\\\")\n*** End Patch\n')
    assert not accepts("rm -rf /\n")
    assert not accepts("*** Begin Patch\n*** Add File: a\nno plus\n*** End Patch\n")
    manager.shutdown()
