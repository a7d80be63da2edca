"""An Anthropic Messages request as what the chat template renders (``ChatPrompt``): chat
messages, the tools as function definitions with how the reply may call them, the template's
switches and the reply's format. Anthropic's own value: no other protocol's request is built.

Mapping (each documented field is honoured, accepted without effect, or refused with a 400):

    system (string or text blocks)   a first "system" message, one text part per block
    text blocks                      text parts of the message
    tool_use (assistant)             ``tool_calls``: arguments = the input as one-line JSON with
                                     ", " and ": " (the form a forced call is generated in, so the
                                     next turn re-renders it byte for byte)
    tool_result (user)               a "tool" message (``tool_call_id``); is_error prefixes
                                     "Error: "; text that follows becomes a new user message
    thinking (assistant)             ``reasoning_content`` (templates that show past reasoning)
    redacted_thinking                dropped: it is opaque and no local model can read it
    role "system" inside messages    a "system" message where it stands
    a final assistant message        a prefill: the reply continues it
    image, document, other blocks    400
    tools (custom)                   functions; name, description, input_schema as parameters;
                                     defer_loading has no effect
    cache_control (tools, system,    the prefix up to that block is retained for its TTL, and
    content blocks)                  usage splits writes by TTL (``cache_control``)
    server tools (typed), MCP        400
    tool_choice auto/any/tool/none   "auto" / "required" / named / "none"; disable_parallel_
                                     tool_use: one call at most; "auto" without
                                     --tool-call-parser shows the tools but parses no calls
    thinking enabled/adaptive/       chat_template_kwargs enable_thinking true/true/false
    disabled
    output_config.format json_schema the reply is constrained to the schema
    output_config.effort, metadata,  accepted without effect
    context_management
    sampling (temperature, top_p,    ``MessagesRequest.sampling_options``; seed, min_p,
    top_k, stop_sequences, ...)      repetition_penalty, ignore_eos, min_tokens and cache_salt
                                     are prefixserve's extensions, as in chat completions

The attribution rule: Claude Code's first system block is
``x-anthropic-billing-header: cc_version=<version>.<3 hex>; cc_entrypoint=<name>;`` (optionally
more ``key=value;`` fields). Its suffix differs between sessions, so kept at the head of the
prompt it would stop every session from sharing the system prompt's and tools' prefix. With
``drop_attribution`` (the server default) that one block, recognised by its exact shape and only
as the first system block, is left out: the model never sees it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from prefixserve.api.anthropic.protocol import CountTokensRequest
from prefixserve.api.frontend.protocol import APIError, ToolRequest
from prefixserve.structured_outputs.params import StructuredOutputsParams

ATTRIBUTION_RE = re.compile(
    r"x-anthropic-billing-header: cc_version=[0-9A-Za-z.+-]+; cc_entrypoint=[0-9A-Za-z_.-]+;"
    r"(?: [0-9A-Za-z_]+=[0-9A-Za-z_.+-]*;)*"
)
THINKING_TYPES = ("enabled", "adaptive", "disabled")
MIN_THINKING_BUDGET = 1024  # Anthropic's lower bound on thinking.budget_tokens


def is_attribution_block(block: Any) -> bool:
    """Claude Code's attribution line: a text block of exactly the shape above."""
    return (
        isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
        and ATTRIBUTION_RE.fullmatch(block["text"]) is not None
    )


@dataclass(frozen=True)
class ChatPrompt:
    """What the chat template renders of a Messages request, and how its reply is read:
    ``messages`` (chat messages), ``tools`` (function definitions, tool mode, parallel calls),
    the template's switches, and ``structured``: the reply's format (``output_config``), None
    without one."""

    messages: list[dict]
    tools: ToolRequest
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None
    structured: StructuredOutputsParams | None


def to_chat_prompt(req: CountTokensRequest, drop_attribution: bool,
                   can_parse_calls: bool) -> ChatPrompt:  # fmt: skip
    """The chat prompt of ``req``; a 400 (``APIError``) on a field that cannot be honoured.
    ``can_parse_calls``: the server has a tool-call parser."""
    _refuse_server_features(req)
    messages = chat_messages(req, drop_attribution)
    prefill = req.messages[-1].role == "assistant"
    tools = convert_tools(req.tools) if req.tools else None
    return ChatPrompt(
        messages, _tool_request(tools, req.tool_choice, can_parse_calls), not prefill, prefill,
        _template_kwargs(req), _output_format(req.output_config),
    )  # fmt: skip


def _refuse_server_features(req: CountTokensRequest) -> None:
    if req.mcp_servers:
        raise APIError("mcp_servers: MCP connectors are not supported", 400, "mcp_servers")
    if req.container is not None:
        raise APIError("container: code-execution containers are not supported", 400, "container")


def chat_messages(req: CountTokensRequest, drop_attribution: bool) -> list[dict]:
    """The chat messages of the system prompt and ``req.messages``."""
    messages = system_messages(req.system, drop_attribution)
    for i, message in enumerate(req.messages):
        messages += _convert(i, message.role, message.content)
    return messages


def convert_tools(tools: list[dict]) -> list[dict]:
    """Anthropic custom tools as OpenAI functions."""
    return [_tool(i, t) for i, t in enumerate(tools)]


def system_messages(system: str | list[dict] | None, drop_attribution: bool) -> list[dict]:
    if system is None:
        return []
    blocks = [{"type": "text", "text": system}] if isinstance(system, str) else system
    if drop_attribution and blocks and is_attribution_block(blocks[0]):
        blocks = blocks[1:]
    parts = [_text_part(b, "system") for b in blocks]
    return [{"role": "system", "content": parts}] if parts else []


def _convert(i: int, role: str, content: str | list[dict]) -> list[dict]:
    """The chat messages of ``messages[i]``."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    where = f"messages[{i}]"
    if role == "assistant":
        return [_assistant(where, content)]
    out: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "tool_result" and role == "user":
            if parts:
                out.append({"role": role, "content": parts})
                parts = []
            out.append(_tool_result(f"{where}.content[{j}]", block))
        else:
            parts.append(_text_part(block, f"{where}.content[{j}]"))
    if parts or not out:
        out.append({"role": role, "content": parts})
    return out


def _assistant(where: str, content: list[dict]) -> dict:
    parts: list[dict] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        at = f"{where}.content[{j}]"
        if kind == "tool_use":
            calls.append(_tool_call(at, block))
        elif kind == "thinking":
            thinking.append(_string(block, "thinking", at))
        elif kind != "redacted_thinking":
            parts.append(_text_part(block, at))
    message: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _tool_call(at: str, block: dict) -> dict:
    name, call_id = _string(block, "name", at), _string(block, "id", at)
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise APIError(f"{at}.input: must be an object", 400, "messages")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}  # fmt: skip


def _tool_result(at: str, block: dict) -> dict:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_part(b, f"{at}.content")["text"] for b in content)
    elif not isinstance(content, str):
        raise APIError(f"{at}.content: must be a string or text blocks", 400, "messages")
    if block.get("is_error"):
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": _string(block, "tool_use_id", at), "content": content}


def _text_part(block: Any, at: str) -> dict:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind != "text":
        raise APIError(
            f"{at}: {kind!r} blocks are not supported here; this model reads text only (send "
            "text blocks)",
            400,
            "messages" if at.startswith("messages") else at,
        )
    return {"type": "text", "text": _string(block, "text", at)}


def _string(block: dict, key: str, at: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise APIError(f"{at}.{key}: must be a string", 400, "messages")
    return value


def _tool(i: int, tool: dict) -> dict:
    """An Anthropic custom tool as an OpenAI function."""
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise APIError(
            f"tools[{i}]: server tool {kind!r} is not supported; define a custom tool with "
            "name, description and input_schema",
            400,
            "tools",
        )
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not isinstance(schema, dict):
        raise APIError(
            f"tools[{i}]: needs a string 'name' and an object 'input_schema'", 400, "tools"
        )
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _tool_request(tools: list[dict] | None, choice: dict | None,
                  can_parse_calls: bool) -> ToolRequest:  # fmt: skip
    """The tools and how the reply may call them (``tool_choice``)."""
    kind = "auto" if choice is None else choice.get("type")
    parallel = not (choice or {}).get("disable_parallel_tool_use", False)
    if kind == "auto":
        mode = "auto" if tools and can_parse_calls else "none"
        return ToolRequest(tools, mode, parallel=parallel)
    if kind == "none":
        return ToolRequest(tools, "none", parallel=parallel)
    if kind == "any":
        return ToolRequest(tools, "required", parallel=parallel)
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str):
            raise APIError(
                'tool_choice: {"type": "tool"} needs a string "name"', 400, "tool_choice"
            )
        return ToolRequest(tools, "named", name, parallel)
    raise APIError(
        f"tool_choice.type: {kind!r} is not supported; use 'auto', 'any', 'tool' or 'none'",
        400,
        "tool_choice",
    )


def _template_kwargs(req: CountTokensRequest) -> dict[str, Any] | None:
    thinking = req.thinking
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in THINKING_TYPES:
        raise APIError(f"thinking.type: must be one of {list(THINKING_TYPES)}", 400, "thinking")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if not isinstance(budget, int) or budget < MIN_THINKING_BUDGET:
            raise APIError(
                f"thinking.budget_tokens: must be an integer >= {MIN_THINKING_BUDGET}",
                400,
                "thinking",
            )
        if max_tokens is not None and budget >= max_tokens:
            raise APIError("thinking.budget_tokens: must be less than max_tokens", 400, "thinking")
    return {"enable_thinking": kind != "disabled"}


def _output_format(output_config: dict | None) -> StructuredOutputsParams | None:
    """``output_config.format``: the JSON schema the reply is constrained to (effort has no
    effect)."""
    fmt = (output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise APIError(
            "output_config.format: only {'type': 'json_schema', 'schema': {...}} is supported",
            400,
            "output_config",
        )
    if not isinstance(fmt.get("schema"), dict):
        raise APIError(
            "output_config.format.schema: must be a JSON schema object", 400, "output_config"
        )
    return StructuredOutputsParams(json=fmt["schema"])
