"""A reasoning budget (Anthropic's ``thinking.budget_tokens``): the reply may reason for at most
``budget`` tokens; a reasoning block still open then is closed, and the answer follows.

::

    engine request A: the reply as asked  -- its reasoning closes within the budget: A is the reply
        | reasoning still open after ``budget`` output tokens
        v abort A, keep its first ``budget`` tokens
    engine request B: prompt + A[:budget] + "\\n</think>\\n\\n"  (A's blocks are cached, so B
                      prefills only its last partial block and the closing tag)
        -> the reply = A[:budget] + closing tag + B, with the prompt, cache figures and request
           of A; B's ``max_tokens`` is what A had left, its grammar the request's without the
           reasoning part (B starts at the answer)

``BudgetedStream`` has ``RequestStream``'s interface (DELTA outputs, ``request_id`` of the
request running now, ``finished``, ``output_kind``), so a ``Generation`` reads it as any stream.
Invariant: its deltas add up to the reply above (outputs until A holds ``budget`` tokens pass
through, so the cut falls at or after the text already sent). The budget is
checked once, on the first output that reaches it (the engine may have gone past it within a
step): whether the reasoning is still open after exactly ``budget`` tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from prefixserve.api.engine_client import EngineClient, RequestStream
from prefixserve.api.parsing.reasoning import THINK_END, reasoning_parser
from prefixserve.core.outputs import CompletionOutput, RequestOutput
from prefixserve.core.sampling_params import RequestOutputKind


class BudgetedStream:
    def __init__(self, engine: EngineClient, stream: RequestStream, prompt_token_ids: list[int],
                 params: Any, budget: int, parser_name: str, prompt_tail: str,
                 timeout: float | None = None) -> None:  # fmt: skip
        self.engine, self.stream, self.budget = engine, stream, budget
        self.prompt_token_ids, self.params, self.timeout = prompt_token_ids, params, timeout
        self._reasoner = lambda: reasoning_parser(parser_name, prompt_tail)

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    @property
    def finished(self) -> bool:
        return self.stream.finished

    @property
    def output_kind(self) -> RequestOutputKind:
        return RequestOutputKind.DELTA

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        generated: list[int] = []  # A's tokens so far
        sent = ""  # A's text so far
        async for out in self.stream:
            c = out.outputs[0]
            if generated is None or len(generated) + len(c.token_ids) < self.budget:
                if generated is not None:
                    generated += c.token_ids
                    sent += c.text
                yield out
                continue
            kept = (generated + c.token_ids)[: self.budget]
            sent_ids, generated = len(generated), None  # decided: the budget is checked once
            skip = getattr(self.params, "skip_special_tokens", True)
            text = self.engine.tokenizer.decode(kept, skip_special_tokens=skip)
            reasoner = self._reasoner()
            reasoner.feed(text)
            if not reasoner.in_reasoning:
                yield out
                continue
            self.engine.abort(out.request_id)
            async for joined in self._answer(out, kept, text, (sent, sent_ids)):
                yield joined
            return

    async def _answer(self, cut: RequestOutput, kept: list[int], text: str,
                      sent: tuple[str, int]) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """The rest of the reply after the budget, as deltas after ``sent`` (A's text and number
        of tokens already out): request B (see the module doc)."""
        c = cut.outputs[0]
        closing = ("" if text.endswith("\n") else "\n") + THINK_END + "\n\n"
        closing_ids = self.engine.tokenizer.encode(closing, add_special_tokens=False)
        head_ids = kept + closing_ids
        grammar = self.params.structured_outputs
        params = dataclasses.replace(
            self.params, max_tokens=max(1, self.params.max_tokens - len(head_ids)),
            structured_outputs=grammar and dataclasses.replace(grammar, reasoning=None),
        )  # fmt: skip
        prepared = self.engine.prepare(self.prompt_token_ids + head_ids, params)
        if prepared.grammar is not None:
            await asyncio.wrap_future(prepared.grammar)
        self.stream = await self.engine.add(cut.request_id + "-answer", prepared,
                                            timeout=self.timeout)  # fmt: skip
        # the first delta carries the cut: what of A[:budget] was not sent, and the closing tag
        head: tuple[str, list[int]] | None = (text[len(sent[0]) :] + closing,
                                              kept[sent[1] :] + closing_ids)  # fmt: skip
        async for out in self.stream:
            answer = out.outputs[0]
            pre_text, pre_ids = head if head is not None else ("", [])
            head = None
            joined = CompletionOutput(
                c.index, pre_text + answer.text, pre_ids + answer.token_ids, logprobs=None,
                finish_reason=answer.finish_reason, stop_reason=answer.stop_reason,
            )  # fmt: skip
            yield dataclasses.replace(cut, outputs=[joined], finished=out.finished,
                                      error=out.error)  # fmt: skip
