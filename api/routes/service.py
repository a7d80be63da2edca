"""GET /health, /version, /v1/models and /v1/models/{id}."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

import prefixserve
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.frontend.protocol import error_body
from prefixserve.api.openai.protocol import ModelCard, ModelList


def service_router(
    engine: AsyncEngine, names: list[str], check_model: Callable[[str], None]
) -> APIRouter:
    """/health is 503 once the engine loop died; the models are ``names``, each serving
    ``engine``'s model (``check_model``: a 404 for any other name)."""
    router = APIRouter()

    @router.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse(
                error_body(f"engine dead: {engine.dead!r}", "EngineDeadError", 503), 503
            )
        return Response(status_code=200)

    @router.get("/version")
    async def version():
        return {"version": prefixserve.__version__}

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)

    @router.get("/v1/models")
    async def models():
        return ModelList(data=[card(name) for name in names])

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return card(model_id)

    return router
