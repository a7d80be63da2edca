"""POST /tokenize and /detokenize (vLLM's): a prompt or a conversation as the token ids the engine
would see, and token ids as text.

Both work off the event loop, the reply's JSON included: a prompt of a few megabytes takes seconds
to tokenize and its millions of ids as long to encode, and every stream and health check would
wait behind it on the loop. A conversation renders as on
/v1/chat/completions (``TemplateServing.render``: its ``chat_template`` is refused unless the
server accepts one, and then bounded). Behind the API key like every route unless the operator
makes them public (``--public-route``).
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from prefixserve.api.frontend.inputs import TemplateServing
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.openai.protocol import DetokenizeRequest, TokenizeRequest


class TokenizationServing:
    """/tokenize and /detokenize over the chat front's tokenizer and template policy."""

    def __init__(self, chat: TemplateServing) -> None:
        self.chat = chat

    async def tokenize(self, req: TokenizeRequest) -> JSONResponse:
        self.chat.check_model(req.model)
        tok = self.chat.engine.tokenizer
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await asyncio.to_thread(
                self.chat.render, req.messages, tools,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                add_special_tokens=bool(req.add_special_tokens),
                chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
            )  # fmt: skip
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await asyncio.to_thread(tok.encode, req.prompt, add_special_tokens=add)
        else:
            raise APIError("tokenize: give either 'prompt' or 'messages'", 400, "prompt")
        return await asyncio.to_thread(self._reply, ids, req.return_token_strs)

    def _reply(self, ids: list[int], token_strs: bool | None) -> JSONResponse:
        body = {"tokens": ids, "count": len(ids), "max_model_len": self.chat.engine.max_model_len}
        if token_strs:
            body["token_strs"] = self.chat.engine.tokenizer.convert_ids_to_tokens(ids)
        return JSONResponse(body)

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.chat.check_model(req.model)
        tok = self.chat.engine.tokenizer
        vocab = len(tok)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                f"tokens: ids {bad[:8]} are outside the vocabulary [0, {vocab})", 400, "tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}
