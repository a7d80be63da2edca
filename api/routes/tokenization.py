"""POST /tokenize and /detokenize (``openai.tokenization``)."""

from __future__ import annotations

from fastapi import APIRouter

from prefixserve.api.openai.protocol import DetokenizeRequest, TokenizeRequest
from prefixserve.api.openai.tokenization import TokenizationServing


def tokenization_router(tokenization: TokenizationServing) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await tokenization.tokenize(req)

    @router.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await tokenization.detokenize(req)

    return router
