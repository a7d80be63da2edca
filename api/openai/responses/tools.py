"""Responses ``tools`` -> the chat template's function tools, and what was left out.

    function                     a function tool (``strict`` true unless false: OpenAI's default)
    namespace (Codex's groups)   its functions, by name; their calls carry the namespace back
    custom (free-form input)     a function of one string parameter ``input`` (its description
                                 carries the tool's grammar, if any); its calls come back as
                                 ``custom_tool_call`` items with that input (``output``)
    tool_search (client-run)     not offered: every tool, deferred ones (``defer_loading``)
                                 included, is in the prompt up front, so there is nothing to find
    hosted (web_search,          not offered: nothing here can run them. Named in the
    file_search, code_interpreter, ``x-prefixserve-tools-not-offered`` response header and counted;
    image_generation,            with ``--hosted-tools refuse`` a 400 instead
    computer_use, mcp)
    anything else                a 400 naming the type

A function name given twice is a 400. A custom tool's Lark grammar (xgrammar reads Lark) constrains
its input wherever a grammar writes its calls, in a syntax whose arguments are JSON (hermes,
llama3_json, mistral): forced calls, and ``auto`` calls with hermes (``custom_grammar``); the
grammar is also shown to the model in the parameter's description.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.openai.responses.custom_grammar import arguments_ebnf
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.json_grammar import EBNF_KEY

HOSTED = ("web_search", "web_search_preview", "web_search_2025_08_26", "file_search",
          "code_interpreter", "image_generation", "computer_use", "computer_use_preview", "mcp")  # fmt: skip
HOSTED_POLICIES = ("accept", "refuse")
JSON_ARGUMENTS = ("hermes", "llama3_json", "mistral")  # syntaxes that write arguments as JSON


@dataclass(slots=True)
class ResponsesTools:
    """``functions``: chat tool definitions (None without any); ``namespaces``: {function: its
    namespace}; ``custom``: names of the custom tools; ``strict``: functions whose ``auto`` calls
    a grammar may constrain; ``not_offered``: the types left out, in order."""

    functions: list[dict[str, Any]] | None = None
    namespaces: dict[str, str] = field(default_factory=dict)
    custom: frozenset[str] = frozenset()
    strict: frozenset[str] = frozenset()
    not_offered: list[str] = field(default_factory=list)
    grammar_functions: list[dict[str, Any]] | None = None


def chat_tools(tools: list[dict[str, Any]] | None, hosted: str = "accept",
               grammars: bool = True) -> ResponsesTools:  # fmt: skip
    """The template's view of Responses ``tools`` (see the module doc); ``grammars``: custom
    tools' grammars may constrain their calls (the call syntax writes arguments as JSON)."""
    out = ResponsesTools()
    functions: list[dict] = []
    custom, strict, ebnf = set(), set(), {}
    for i, tool in enumerate(tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("name"), str):
            for inner in tool.get("tools") or []:
                functions.append(_function(i, inner))
                out.namespaces[inner["name"]] = tool["name"]
                strict |= _strict(inner)
        elif kind == "custom":
            functions.append(_custom(i, tool))
            custom.add(tool["name"])
            fmt = tool.get("format") or {}
            if grammars and fmt.get("type") == "grammar":
                ebnf[tool["name"]] = _arguments_ebnf(i, fmt)
        elif kind == "tool_search" or (kind in HOSTED and hosted == "accept"):
            out.not_offered.append(kind)
        elif kind in HOSTED:
            raise _refused(i, f"{kind!r} is a hosted tool that runs on OpenAI's side; nothing "
                              "here can run it (this server refuses hosted tools: --hosted-tools "
                              "refuse)")  # fmt: skip
        else:
            functions.append(_function(i, tool))
            strict |= _strict(tool)
    names = [t["function"]["name"] for t in functions]
    for name in names:
        if names.count(name) > 1:
            raise APIError(f"tools: the function name {name!r} is given twice", 400, "tools")
    out.functions = functions or None
    out.custom, out.strict = frozenset(custom), frozenset(strict | set(ebnf))
    if ebnf:
        out.grammar_functions = [_with_grammar(f, ebnf.get(f["function"]["name"]))
                                 for f in functions]  # fmt: skip
    return out


def _arguments_ebnf(i: int, fmt: dict[str, Any]) -> str:
    syntax, definition = fmt.get("syntax", "lark"), fmt.get("definition")
    if syntax not in ("lark", "regex") or not isinstance(definition, str):
        raise _refused(i, "a custom tool's grammar is {'syntax': 'lark' | 'regex', 'definition'}")
    try:
        return arguments_ebnf(definition, syntax)
    except InvalidArgumentError as exc:
        raise _refused(i, str(exc)) from exc


def _with_grammar(function: dict[str, Any], ebnf: str | None) -> dict[str, Any]:
    if ebnf is None:
        return function
    parameters = {**function["function"]["parameters"], EBNF_KEY: ebnf}
    return {"type": "function", "function": {**function["function"], "parameters": parameters}}


def _strict(tool: dict[str, Any]) -> set[str]:
    return {tool["name"]} if tool.get("strict") is not False else set()


def _refused(i: int, why: str) -> APIError:
    return APIError(f"tools[{i}]: {why}", 400, "tools")


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _refused(i, f"tool type {kind!r} is not supported: use function, custom, namespace "
                          "or tool_search tools (hosted ones are not offered)")  # fmt: skip
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _refused(i, "a function tool needs a 'name'")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k)}
    return {"type": "function", "function": function}


def _custom(i: int, tool: dict[str, Any]) -> dict[str, Any]:
    """A custom tool as a function of one string parameter ``input``."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise _refused(i, "a custom tool needs a 'name'")
    fmt = tool.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise _refused(i, "a custom tool's format is {'type': 'text'} or {'type': 'grammar', ...}")
    about = "The tool's free-form input."
    if fmt.get("type") == "grammar":
        about += f" It matches this {fmt.get('syntax', 'lark')} grammar:\n{fmt.get('definition')}"
    elif fmt.get("type") != "text":
        raise _refused(i, "a custom tool's format is text or a grammar")
    parameters = {"type": "object", "properties": {"input": {"type": "string",
                  "description": about}}, "required": ["input"]}  # fmt: skip
    function = {"name": tool["name"], "parameters": parameters}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}
