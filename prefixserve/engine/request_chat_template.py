"""A chat template a request brings (``chat_template``), rendered under bounds.

The checkpoint's template is the operator's: transformers renders it. A request's template is the
client's code, refused unless the server runs with ``--allow-client-chat-template``, and then
rendered here: in transformers' own jinja2 sandbox (the same filters, globals and extensions, so
a template renders the same text it would there, ``lipsum`` left out) with three bounds, each an
``InvalidArgumentError`` on ``chat_template`` the moment it is crossed::

    output   the text written, counted as it is written             <= max_output_chars
    steps    every loop iteration (recursive ``loop(...)`` too), call  <= max_steps
             (function, method, macro, filter) and growing operator
             costs one, and one more per STEP_CHARS characters made
    size     a value ``*``, ``+``, ``~``, ``**``, ``%``, ``join``,      <= max_output_chars items
             ``replace`` or a width argument would make is checked      (an int: MAX_INT_BITS)
             before it is made; every call's result after

So ``{{ 'ab ' * 1000000 }}``, nested ``range()`` loops, macro recursion and doubling a string in a
loop all end in a 400 after bounded work. The bounds do not make a hostile template harmless
(``str()`` of a large container is made before it is measured): the flag is for clients trusted
to run code on the server. Loops are counted by rewriting the template's syntax tree (each
``for`` iterates ``_COUNT(iterable)``, each ``~`` is ``_CONCAT(...)``); a template that names
those two is refused.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from prefixserve.core.errors import InvalidArgumentError

DEFAULT_MAX_STEPS = 1_000_000
CHARS_PER_TOKEN = 16
STEP_CHARS = 1024
MAX_INT_BITS = 4096
_COUNT, _CONCAT = "__prefixserve_count", "__prefixserve_concat"
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker of the text to continue
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True, slots=True)
class TemplateLimits:
    """The bounds one request's template renders under (see the module doc)."""

    max_output_chars: int
    max_steps: int = DEFAULT_MAX_STEPS

    @classmethod
    def of_server(cls, max_request_body_bytes: int, max_model_len: int) -> TemplateLimits:
        """A server's: no more text than a client may send, nor than ``CHARS_PER_TOKEN`` per
        token of the context (a longer prompt could not run anyway)."""
        return cls(min(max_request_body_bytes, CHARS_PER_TOKEN * max_model_len))


class TemplateLimitError(InvalidArgumentError):
    """A request's template crossed a bound (a 400 on ``chat_template``)."""

    def __init__(self, why: str) -> None:
        super().__init__(f"chat_template: {why}; simplify the template", "chat_template")


class _Budget:
    """What one render has spent."""

    __slots__ = ("limits", "steps", "written")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits, self.steps, self.written = limits, 0, 0

    def spend(self, steps: int = 1) -> None:
        self.steps += steps
        if self.steps > self.limits.max_steps:
            raise TemplateLimitError(f"it ran past {self.limits.max_steps} steps (loop "
                                     "iterations, calls and operators)")  # fmt: skip

    def made(self, size: int) -> None:
        """A value of ``size`` items is (about to be) made."""
        if size > self.limits.max_output_chars:
            raise TemplateLimitError(f"it makes a value of {size} items, past the bound of "
                                     f"{self.limits.max_output_chars}")  # fmt: skip
        self.spend(1 + size // STEP_CHARS)

    def count(self, value: Any) -> None:
        """An int argument (a width, a count) past the output bound could never be written."""
        if _is_int(value) and abs(value) > self.limits.max_output_chars:
            raise TemplateLimitError(f"a width or count of {value} is past the bound of "
                                     f"{self.limits.max_output_chars}")  # fmt: skip

    def bits(self, bits: int) -> None:
        if bits > MAX_INT_BITS:
            raise TemplateLimitError(f"it makes an integer of about {bits} bits, past the bound "
                                     f"of {MAX_INT_BITS}")  # fmt: skip

    def write(self, chars: int) -> None:
        self.written += chars
        if self.written > self.limits.max_output_chars:
            raise TemplateLimitError(f"it writes more than {self.limits.max_output_chars} "
                                     "characters")  # fmt: skip


_BUDGET: ContextVar[_Budget | None] = ContextVar("request_template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:
        raise RuntimeError("a request's template renders only through render_request_template")
    return budget


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict, set, frozenset)) else 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_format(budget: _Budget, fmt: str, values: Any = ()) -> None:
    """Widths and precisions inside a format string (``'%9999999d'``, ``'{:>9999999}'``), and
    the ``values`` a ``*`` width takes them from (``'%*d' % (n, x)``)."""
    cap = budget.limits.max_output_chars
    for number in _NUMBER.findall(fmt):  # digits past the cap's length are past the cap
        budget.count(int(number.lstrip("0")[: len(str(cap)) + 1] or 0))
    if "*" in fmt:
        for value in values if isinstance(values, tuple) else (values,):
            budget.count(value)


def _binop_size(budget: _Budget, op: str, left: Any, right: Any) -> int:
    """The size of ``left op right`` before it is computed (0: not a growing case)."""
    if op == "*" and _is_int(left) and _is_int(right):
        budget.bits(left.bit_length() + right.bit_length())
    elif op == "*" and _is_int(right):
        return _size(left) * max(right, 0)
    elif op == "*" and _is_int(left):
        return _size(right) * max(left, 0)
    elif op == "+":
        return _size(left) + _size(right)
    elif op == "**" and _is_int(left) and _is_int(right) and right > 0:
        budget.bits(abs(left).bit_length() * right)
    elif op == "%" and isinstance(left, str):
        _check_format(budget, left, right)
    return 0


def _joined_size(items: list, sep: str) -> int:
    return sum(len(x) for x in items if isinstance(x, str)) + len(sep) * max(len(items) - 1, 0)


def _replaced_size(s: Any, old: Any, new: Any) -> int:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = s.count(old) if old else len(s) + 1
    return len(s) + hits * (len(new) - len(old))


def _finalize(value: Any) -> str:
    """Every ``{{ ... }}`` value, as the text it writes, measured before it is kept (in the output,
    a macro's or a ``{% set %}`` block's); also run on constants when a template compiles."""
    text = value if isinstance(value, str) else str(value)
    budget = _BUDGET.get()
    if budget is not None:
        budget.made(len(text))
    return text


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with the bounds of the module doc (of the render in
    progress, ``_BUDGET``)."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.made(_binop_size(budget, operator, left, right))
        result = super().call_binop(context, operator, left, right)
        budget.made(_size(result))
        return result

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        name = getattr(__obj, "__name__", "")
        if not isinstance(owner, str):
            pass
        elif name in ("format", "format_map"):  # the sandbox's wrapper of str.format
            _check_format(budget, owner)
        elif name == "join" and args:
            args = (list(args[0]), *args[1:])
            budget.made(_joined_size(args[0], owner))
        elif name == "replace" and len(args) >= 2:
            budget.made(_replaced_size(owner, args[0], args[1]))
        else:  # widths and counts: ljust, center, zfill, expandtabs, ...
            for value in (*args, *kwargs.values()):
                budget.count(value)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.made(_size(result))
        return result


def _bounded_filter(name: str, f: Any) -> Any:
    """``f`` with its int arguments (after the value), ``join``'s and ``replace``'s sizes and its
    result bounded. ``functools.wraps`` keeps jinja's pass-context marker, so the arguments
    arrive as they would: the context first when it is marked, then the value."""
    at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # where the value is

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        budget.spend()
        for value in (*args[at + 1 :], *kwargs.values()):
            budget.count(value)
        if name == "join" and len(args) > at and "attribute" not in kwargs:
            args = (*args[:at], list(args[at]), *args[at + 1 :])
            sep = args[at + 1] if len(args) > at + 1 else kwargs.get("d", "")
            budget.made(_joined_size(args[at], str(sep)))
        elif name == "replace" and len(args) >= at + 3:
            budget.made(_replaced_size(*args[at : at + 3]))
        result = f(*args, **kwargs)
        budget.made(_size(result))
        return result

    return bounded


def _counted(iterable: Iterable) -> Iterator:
    budget = _budget()
    for item in iterable:
        budget.spend()
        yield item


def _concat(*parts: Any) -> str:
    budget = _budget()
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    budget.made(sum(map(len, texts)))
    return "".join(texts)


class _CountLoops(NodeTransformer):
    """Each ``for`` iterates ``_COUNT(iterable)`` (and a recursive ``loop(children)`` too); each
    ``~`` is ``_CONCAT(...)``."""

    @staticmethod
    def _call(name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        return nodes.Call(nodes.Name(name, "load", lineno=lineno), args, [], None, None,
                          lineno=lineno)  # fmt: skip

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = self._call(_COUNT, [node.iter], node.lineno)
        return node

    def visit_Call(self, node: nodes.Call) -> nodes.Node:
        node = self.generic_visit(node)
        if isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.args:
            node.args[0] = self._call(_COUNT, [node.args[0]], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return self._call(_CONCAT, list(node.nodes), node.lineno)


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    """The bounded twin of the environment transformers renders chat templates in."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    base = _compile_jinja_template("").environment
    env = BoundedEnvironment(trim_blocks=base.trim_blocks, lstrip_blocks=base.lstrip_blocks,
                             extensions=[type(e) for e in base.extensions.values()],
                             finalize=_finalize)  # fmt: skip
    env.filters = {name: _bounded_filter(name, f) for name, f in base.filters.items()}
    env.globals = {k: v for k, v in base.globals.items() if k != "lipsum"}
    env.globals.update({_COUNT: _counted, _CONCAT: _concat})
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    env = _environment()
    ast = env.parse(source)
    named = {n.name for n in ast.find_all(nodes.Name)} | {m.name for m in ast.find_all(nodes.Macro)}
    if named & {_COUNT, _CONCAT}:
        raise TemplateLimitError(f"the names {_COUNT} and {_CONCAT} are reserved")
    return env.from_string(_CountLoops().visit(ast))


def render_request_template(
    tokenizer: Any,
    source: str,
    messages: list[dict[str, Any]],
    limits: TemplateLimits,
    variables: dict[str, Any],
    continue_final_message: bool = False,
) -> str:
    """The text ``source`` renders for ``messages`` within ``limits``. ``variables``: ``tools``,
    ``documents``, ``add_generation_prompt`` and the template kwargs, over the tokenizer's special
    tokens (as transformers gives them); ``continue_final_message`` ends the text where the final
    message's content ends, as transformers does."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if continue_final_message:
        messages[-1] = _tagged(messages[-1])
    budget = _Budget(limits)
    token = _BUDGET.set(budget)
    try:
        chunks = []
        template = _compile(source)
        for chunk in template.generate(**{**tokenizer.special_tokens_map, **variables,
                                          "messages": messages}):  # fmt: skip
            budget.write(len(chunk))
            chunks.append(chunk)
    except TemplateLimitError:
        raise
    except Exception as exc:
        raise InvalidArgumentError(f"chat_template: the template failed: {exc}",
                                   "chat_template") from exc  # fmt: skip
    finally:
        _BUDGET.reset(token)
    text = "".join(chunks)
    return _cut_at_tag(text) if continue_final_message else text


def _tagged(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    parts = list(content or [])
    for k in reversed(range(len(parts))):
        if isinstance(parts[k], dict) and isinstance(parts[k].get("text"), str):
            parts[k] = {**parts[k], "text": parts[k]["text"] + _CONTINUE_TAG}
            return {**message, "content": parts}
    raise InvalidArgumentError("continue_final_message: the final message has no text to "
                               "continue", "continue_final_message")  # fmt: skip


def _cut_at_tag(text: str) -> str:
    mark = _CONTINUE_TAG.strip()
    if mark not in text:
        raise InvalidArgumentError("continue_final_message: the template does not write the "
                                   "final message's content", "continue_final_message")  # fmt: skip
    at = text.rindex(mark)
    return text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()
