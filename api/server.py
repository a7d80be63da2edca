"""The FastAPI app (``create_app``) and the uvicorn runner behind ``prefixserve serve``.

Routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /version, /tokenize,
/detokenize, /metrics, /dashboard, /stats. Every error is an OpenAI-shaped body: 400 for any
invalid input (schema, JSON, values, context length), 401 for a missing or wrong API key on /v1/*,
404 for an unknown model. /health answers 503 once the engine loop has died; the runner then stops
uvicorn and ``serve`` returns 1.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prefixserve.api.async_engine import AsyncEngine, EngineDeadError
from prefixserve.api.dashboard import dashboard_router
from prefixserve.api.metrics import ServerMetrics
from prefixserve.api.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    error_body,
)
from prefixserve.api.serving_chat import ChatServing, render_chat
from prefixserve.api.serving_completion import CompletionServing
from starlette.exceptions import HTTPException as StarletteHTTPException

import prefixserve
from prefixserve.errors import CacheCapacityError, InvalidArgumentError

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    tool_call_parser: str | None = None


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """One app per engine; its metrics registry and handlers hold no module-level state."""
    metrics = ServerMetrics(config.served_model_names[0], engine.snapshot)
    engine.observer = metrics.observe_step
    chat = ChatServing(engine, config.served_model_names, config.tool_call_parser)
    completion = CompletionServing(engine, config.served_model_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="prefixserve", version=prefixserve.__version__, lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        return _error(APIError(_validation_message(exc), 400))

    async def on_engine_error(_: Request, exc: Exception):
        return _error(APIError(str(exc), 400, getattr(exc, "param", None)))

    async def on_engine_dead(_: Request, exc: Exception):
        return _error(APIError(str(exc), 500))

    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(InvalidArgumentError, on_engine_error)
    app.add_exception_handler(CacheCapacityError, on_engine_error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(
                str(exc.detail),
                "NotFoundError" if exc.status_code == 404 else "BadRequestError",
                exc.status_code,
            ),
            exc.status_code,
        )

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if config.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {config.api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return _error(APIError("Unauthorized: a valid API key is required", 401))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return JSONResponse(
                error_body(f"engine dead: {engine.dead!r}", "EngineDeadError", 503), 503
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": prefixserve.__version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(
            data=[
                ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
                for name in config.served_model_names
            ]
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request):
        return _respond(await chat.create(req, raw_request))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request):
        return _respond(await completion.create(req, raw_request))

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        completion.check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            ids = await asyncio.to_thread(
                render_chat, tok, req.messages, None, req.add_generation_prompt
            )
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError("tokenize: give either 'prompt' or 'messages'", 400, "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        completion.check_model(req.model)
        vocab = len(engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                f"tokens: ids {bad[:8]} are outside the vocabulary [0, {vocab})", 400, "tokens"
            )
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(dashboard_router(engine, metrics))
    return app


def _respond(result):
    if hasattr(result, "__aiter__"):
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return result


def run_server(
    engine_kwargs: dict, host: str, port: int, config: ServerConfig, log_level: str
) -> int:
    """Load the engine, serve until stopped; 1 if the engine loop died, else 0."""
    import uvicorn

    from prefixserve.config import EngineConfig
    from prefixserve.engine import LLMEngine

    llm_engine = LLMEngine(EngineConfig(**engine_kwargs))
    if not config.served_model_names:
        config.served_model_names = [llm_engine.model_name]
    engine = AsyncEngine(llm_engine)
    app = create_app(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    )

    def on_death(exc: BaseException) -> None:
        logger.error("stopping the server: the engine loop died (%r)", exc)
        server.should_exit = True

    engine.on_death = on_death
    logger.info("serving %s on http://%s:%d", config.served_model_names[0], host, port)
    server.run()
    return 1 if engine.dead is not None else 0
