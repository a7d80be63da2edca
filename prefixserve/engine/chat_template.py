"""Chat messages -> prompt token ids, through the checkpoint's chat template.

Message ``content`` comes as a string or as OpenAI content parts (``[{"type": "text", "text":
...}, ...]``). Templates expect one or the other, so content is normalized to the template's
*content format* first:

    "string"  every content becomes one string (text parts joined with "\\n", as vLLM does)
    "openai"  every content becomes a list of {"type": "text", "text": ...} parts
    "auto"    "openai" if the template loops over a message's content, else "string"

So a message renders the same whichever form the client used. Parts other than text (images,
audio, files) are refused: the models served here read text only.

The template renders text, which is then tokenized without adding special tokens (the template
writes BOS itself) unless ``add_special_tokens``. ``continue_final_message`` leaves the final
assistant message open so the model continues it; it excludes ``add_generation_prompt``.

Tool calls in assistant messages carry ``arguments`` as the JSON text OpenAI clients send back.
Templates that test ``arguments is string`` (hermes, Qwen) write it verbatim; the others (Llama,
Mistral, Qwen3-Coder) iterate or ``tojson`` it, so for them it is parsed into a dict first, as
vLLM does. Either way a call generated in the template's syntax re-renders byte for byte.

A ``chat_template`` given with ``template_limits`` is a request's (the client's code): it renders
under those bounds in ``request_chat_template``; without, it is trusted as the checkpoint's is
(the offline ``LLM``).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.nodes

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.request_chat_template import TemplateLimits, render_request_template

CONTENT_FORMATS = ("auto", "string", "openai")
_TEXT_PARTS = ("text", "input_text")


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], *, add_special_tokens: bool = False,
    **options: Any,
) -> list[int]:
    """Prompt token ids of a conversation (``options``: ``render_chat_text``'s); raises
    ``InvalidArgumentError`` (param "messages" or the option at fault) on anything the template
    cannot take."""
    text = render_chat_text(tokenizer, messages, **options)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    content_format: str = "auto",
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    documents: list[dict] | None = None,
    template_limits: TemplateLimits | None = None,
) -> str:
    """The text the chat template renders for a conversation (``render_chat`` tokenizes it);
    ``template_limits``: the bounds a given ``chat_template`` renders under (see the module doc)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidArgumentError(
            "continue_final_message: cannot be combined with add_generation_prompt=true; set "
            "add_generation_prompt to false to continue the final assistant message",
            "continue_final_message",
        )
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise InvalidArgumentError(
            "continue_final_message: the last message must be the assistant's, to continue it",
            "continue_final_message",
        )
    if content_format not in CONTENT_FORMATS:
        raise InvalidArgumentError(
            f"chat_template_content_format: must be one of {CONTENT_FORMATS}, got "
            f"{content_format!r}",
            "chat_template_content_format",
        )
    template = chat_template or tokenizer.chat_template
    fmt = content_format
    if fmt == "auto":
        fmt = detect_content_format(template) if isinstance(template, str) else "string"
    conversation = [_normalize(i, m, fmt) for i, m in enumerate(messages)]
    if isinstance(template, str) and not takes_string_arguments(template):
        conversation = [_parsed_arguments(m) for m in conversation]
    kwargs = dict(chat_template_kwargs or {})
    if chat_template is not None and template_limits is not None:
        variables = {**kwargs, "tools": tools, "documents": documents,
                     "add_generation_prompt": add_generation_prompt}  # fmt: skip
        return render_request_template(tokenizer, chat_template, conversation, template_limits,
                                       variables, continue_final_message)  # fmt: skip
    try:
        return tokenizer.apply_chat_template(
            conversation, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False,
            continue_final_message=continue_final_message, **kwargs,
        )  # fmt: skip
    except Exception as exc:
        raise InvalidArgumentError(
            f"messages: the chat template failed: {exc}", "messages"
        ) from exc


def _normalize(index: int, message: dict[str, Any], fmt: str) -> dict[str, Any]:
    """The message with its content in ``fmt``; a non-text part is an error. A missing or null
    content (an assistant turn that only calls tools) is no text, as vLLM renders it: ``""`` or
    ``[]``, so templates that concatenate ``message['content']`` (SmolLM2's) render it too."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidArgumentError(
            f"messages[{index}]: every message needs a string 'role'", "messages"
        )
    content = message.get("content")
    if content is None:
        texts: list[str] = []
    elif isinstance(content, str):
        texts = [content]
    elif isinstance(content, list):
        texts = [_part_text(index, j, part) for j, part in enumerate(content)]
    else:
        raise InvalidArgumentError(
            f"messages[{index}].content: must be a string or a list of content parts", "messages"
        )
    if fmt == "string":
        return {**message, "content": "\n".join(texts)}
    return {**message, "content": [{"type": "text", "text": t} for t in texts]}


def _parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its tool calls' JSON-object ``arguments`` strings parsed into dicts, and
    ``name`` before ``arguments`` (templates that ``tojson`` the function, as Mistral's, write
    the keys in order; the openai SDK's ``model_dump`` puts ``arguments`` first)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except ValueError:
                value = None
            if isinstance(value, dict):  # name first, as OpenAI documents it (clients vary)
                ordered = {"name": function.get("name"), "arguments": value, **function}
                call = {**call, "function": {**ordered, "arguments": value}}
        parsed.append(call)
    return {**message, "tool_calls": parsed}


@lru_cache(maxsize=32)
def takes_string_arguments(template: str) -> bool:
    """Whether the template tests ``... .arguments is string`` (so it renders JSON text)."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return True
    return any(
        test.name == "string" and _is_attr(test.node, "arguments")
        for test in ast.find_all(jinja2.nodes.Test)
    )


def _is_attr(node: jinja2.nodes.Node, name: str) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == name
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == name
    return False


def _part_text(index: int, j: int, part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise InvalidArgumentError(
            f"messages[{index}].content[{j}]: this model accepts text only (got a {kind!r} "
            "part); send text parts or a string",
            "messages",
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidArgumentError(
            f"messages[{index}].content[{j}]: a text part needs a string 'text'", "messages"
        )
    return text


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """ "openai" if the template loops over a message's content (directly, or over a variable
    set from it), else "string" (vLLM's ``--chat-template-content-format auto``)."""
    try:
        ast = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_vars = {
        node.target.name
        for node in ast.find_all(jinja2.nodes.Assign)
        if isinstance(node.target, jinja2.nodes.Name) and _is_content(node.node, set())
    }
    for loop in ast.find_all(jinja2.nodes.For):
        if _is_content(loop.iter, content_vars):
            return "openai"
    return "string"


def _is_content(node: jinja2.nodes.Node, content_vars: set[str]) -> bool:
    """``x.content``, ``x['content']`` or a variable set from one of those."""
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Name):
        return node.name in content_vars
    return False
