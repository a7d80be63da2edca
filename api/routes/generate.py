"""The four protocols' generation routes: POST /v1/chat/completions, /v1/completions,
/v1/responses, /v1/messages (each a JSON body or an event stream), and
/v1/messages/count_tokens."""

from __future__ import annotations

from fastapi import APIRouter

from prefixserve.api.anthropic.messages import MessagesServing
from prefixserve.api.anthropic.protocol import CountTokensRequest
from prefixserve.api.openai.chat import ChatServing
from prefixserve.api.openai.completions import CompletionServing
from prefixserve.api.openai.responses.serving import ResponsesServing


def generation_router(
    chat: ChatServing,
    completion: CompletionServing,
    responses: ResponsesServing,
    messages: MessagesServing,
) -> APIRouter:
    router = APIRouter()
    for path, create in (
        ("/v1/chat/completions", chat.create),
        ("/v1/completions", completion.create),
        ("/v1/responses", responses.create),
        ("/v1/messages", messages.create),
    ):
        router.add_api_route(path, create, methods=["POST"])

    @router.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)

    return router
