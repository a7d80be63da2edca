"""Grammar compilation for one engine: ``StructuredOutputManager``.

Data flow::

    HTTP layer ── validate(params) ─┐                       (a bad schema is a 400, nothing queued)
    engine ────── submit(params) ───┤ key hit? ── yes ──> the same Future (counted in num_cache_hits)
                                    └── no ──> thread pool: xgrammar compile ──> Future
    engine, when the Future is done: grammar = new_grammar(future.result())  (one per sequence)

Compiles never run on the calling thread, and xgrammar releases the GIL while it compiles, so
the engine keeps stepping. ``GrammarCompiler`` is thread-safe (several pool threads share it).
A grammar that cannot be compiled makes its Future carry an ``InvalidArgumentError``; failures
are not cached. Compiled grammars are kept in an LRU keyed by ``params.key`` and bounded by
``cache_limit_bytes`` (xgrammar's own cache is on with the same bound).
"""

from __future__ import annotations

import bisect
import itertools
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.structured_outputs.grammar import Grammar
from prefixserve.structured_outputs.json_grammar import ANY_OBJECT, json_schema_ebnf
from prefixserve.structured_outputs.params import StructuredOutputsParams, canonical_json
from prefixserve.structured_outputs.structural_tag import xgrammar_structural_tag
from prefixserve.structured_outputs.tool_call_syntaxes import MARKER_TOKENS
from prefixserve.structured_outputs.tool_calls import tool_call_structural_tag

# xgrammar's messages start with a log prefix: "[23:51:11] /project/cpp/x.cc:94: Check failed: ..."
_LOG_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: .*? is false: )?")
_FAILED = {
    "json": "structured_outputs.json is not a JSON schema prefixserve can compile",
    "json_object": "The JSON object grammar failed to compile",
    "regex": "structured_outputs.regex is not a regular expression prefixserve can compile",
    "choice": "structured_outputs.choice failed to compile",
    "grammar": "structured_outputs.grammar is not EBNF prefixserve can compile (xgrammar's "
    "dialect, with a rule named root)",
    "structural_tag": "structured_outputs.structural_tag is not a structural tag prefixserve can "
    "compile",
    "tool_calls": "The parameters of a function in tools are not a JSON schema prefixserve can "
    "compile",
}


class StructuredOutputManager:
    """Compiles ``StructuredOutputsParams`` for one model, off the engine thread, with a cache.

    ``vocab_size`` is the model's logits width (may exceed ``len(tokenizer)``). ``stop_token_ids``
    are the engine's EOS ids (default: the tokenizer's EOS): the only tokens allowed once the
    grammar is complete. Figures: ``num_compiles``, ``num_cache_hits`` and ``compile_seconds``
    (every compile's duration, failed ones included), read with ``stats()``.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] | None = None,
        max_workers: int = 2,
        cache_limit_bytes: int = 256 << 20,
    ) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info,
            max_threads=max_workers,
            cache_enabled=True,
            cache_limit_bytes=cache_limit_bytes,
        )
        self._decoded_vocab = self.tokenizer_info.decoded_vocab
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="structured-outputs")
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None
        self._lock = threading.Lock()  # guards everything below
        self._cache: OrderedDict[tuple[str, ...], Future[xgr.CompiledGrammar]] = OrderedDict()
        self._cached_sizes: dict[tuple[str, ...], int] = {}  # compiled (not in-flight) entries
        self._cache_limit_bytes = cache_limit_bytes
        self.compile_seconds = CompileHistogram()
        self.num_compiles = 0
        self.num_cache_hits = 0

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """A Future of the compiled grammar; equal ``params.key``s share one compile."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._pool.submit(self._compile, key, params)
            self._cache[key] = future
            self.num_compiles += 1
        return future

    def validate(self, params: StructuredOutputsParams) -> None:
        """Compile now (blocking) and raise ``InvalidArgumentError`` if the grammar is bad.

        The result stays cached, so the engine's later ``submit`` is a hit. From asyncio, use
        ``await asyncio.wrap_future(manager.submit(params))`` instead of blocking the loop.
        """
        self.submit(params).result()

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> Grammar:
        """A fresh per-sequence ``Grammar`` at the start of ``compiled``."""
        return Grammar(xgr.GrammarMatcher(compiled), self._decoded_vocab, self._tokenizer)

    def fill_bitmasks(
        self, grammars: Sequence[Grammar], bitmask: torch.Tensor, rows: Sequence[int]
    ) -> None:
        """``grammars[i].fill_bitmask(bitmask, rows[i])`` for all i, on xgrammar's threads."""
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher()
        matchers = [g.matcher for g in grammars]
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, list(rows))

    def stats(self) -> dict[str, Any]:
        """Cumulative figures: compiles, cache hits and the compile-time histogram."""
        with self._lock:
            return {
                "num_compiles": self.num_compiles,
                "num_cache_hits": self.num_cache_hits,
                "compile_seconds": self.compile_seconds.snapshot(),
            }

    def shutdown(self) -> None:
        """Stop the pool; compiles not yet started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(
        self, key: tuple[str, ...], params: StructuredOutputsParams
    ) -> xgr.CompiledGrammar:
        """Runs on a pool thread."""
        start = time.perf_counter()
        try:
            compiled = self._build(params)
        except Exception as e:
            with self._lock:
                self.compile_seconds.observe(time.perf_counter() - start)
                self._cache.pop(key, None)
            reason = _LOG_PREFIX.sub("", str(e)).strip()
            param = "tools" if params.kind == "tool_calls" else "structured_outputs"
            raise InvalidArgumentError(f"{_FAILED[params.kind]}: {reason}", param=param) from None
        with self._lock:
            self.compile_seconds.observe(time.perf_counter() - start)
            if key in self._cache:
                self._cached_sizes[key] = compiled.memory_size_bytes
                self._evict()
        return compiled

    def _build(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        if params.reasoning is not None:
            return self._compiler.compile_structural_tag(_after_reasoning(params))
        compiler, kind = self._compiler, params.kind
        if kind in ("json", "json_object"):
            schema = params.inner_key[1] if kind == "json" else ANY_OBJECT
            return compiler.compile_grammar(json_schema_ebnf(schema))
        if kind == "regex":
            return compiler.compile_regex(params.inner_key[1])
        if kind == "choice":
            return compiler.compile_grammar(_choice_ebnf(params))
        if kind == "grammar":
            return compiler.compile_grammar(params.inner_key[1])
        if kind == "structural_tag":
            return compiler.compile_structural_tag(
                xgrammar_structural_tag(params.structural_tag_spec)
            )
        assert kind == "tool_calls" and params.tool_calls is not None
        return compiler.compile_structural_tag(tool_call_structural_tag(params.tool_calls))

    def _evict(self) -> None:
        """Drop least recently used compiled entries while over the byte limit (lock held)."""
        total = sum(self._cached_sizes.values())
        for key in list(self._cache):
            if total <= self._cache_limit_bytes:
                break
            if key in self._cached_sizes:
                total -= self._cached_sizes.pop(key)
                del self._cache[key]


def _choice_ebnf(params: StructuredOutputsParams) -> str:
    # JSON string escapes are also EBNF string-literal escapes.
    return "root ::= " + " | ".join(canonical_json(c) for c in params.choice or ())


def _after_reasoning(params: StructuredOutputsParams) -> dict[str, Any]:
    """A structural tag: the reasoning block (``params.reasoning``), newlines, then the kind."""
    assert params.reasoning is not None
    begin, end = params.reasoning
    kind, text = params.inner_key
    if kind == "tool_calls":
        assert params.tool_calls is not None
        inner = tool_call_structural_tag(params.tool_calls)["format"]
    elif kind == "regex":
        inner = {"type": "regex", "pattern": text}
    else:
        grammar = {"json": lambda: json_schema_ebnf(text),
                   "json_object": lambda: json_schema_ebnf(ANY_OBJECT),
                   "choice": lambda: _choice_ebnf(params), "grammar": lambda: text}[kind]()  # fmt: skip
        inner = {"type": "grammar", "grammar": grammar}
    think = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": end}
    newlines = {"type": "grammar", "grammar": 'root ::= "\\n"*'}
    return {"type": "structural_tag", "format": {"type": "sequence",
                                                 "elements": [think, newlines, inner]}}  # fmt: skip


class CompileHistogram:
    """Compile durations in fixed buckets (Prometheus' cumulative ``le`` form on ``snapshot``)."""

    BOUNDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)

    def __init__(self) -> None:
        self.counts = [0] * (len(self.BOUNDS) + 1)  # the last bucket is +Inf
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.BOUNDS, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """``{"buckets": [(le, cumulative count)], "sum", "count"}``; ``le`` of +Inf last."""
        cumulative = list(itertools.accumulate(self.counts))
        bounds = [*self.BOUNDS, float("inf")]
        return {"buckets": list(zip(bounds, cumulative)), "sum": self.sum, "count": cumulative[-1]}


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None
) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocab: ``vocab_size`` ids, special tokens writing no text.

    xgrammar only treats empty tokens as special, so ``<|im_start|>`` would count as the text
    "<|im_start|>". Special tokens (BOS, EOS, ChatML markers, ...) are blanked here: they can
    never be matched as text, and the stop tokens among them stay allowed at the end. The
    exception is a tool-call marker (``MARKER_TOKENS``, e.g. Mistral's ``[TOOL_CALLS]``): a forced
    call writes it as the one token its template renders, so the next turn hits the cache.
    """
    stop = list(stop_token_ids) if stop_token_ids is not None else None
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop
    )
    special = set(tokenizer.all_special_ids)
    special.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    special -= {i for i, t in tokenizer.added_tokens_decoder.items() if t.content in MARKER_TOKENS}
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            encoded_vocab[token_id] = token
    return xgr.TokenizerInfo(
        encoded_vocab,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )
