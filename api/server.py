"""The FastAPI app (``create_app``) and the uvicorn runner behind ``prefixserve serve``.

Routes: /v1/chat/completions, /v1/completions, /v1/responses (+ GET/DELETE
/v1/responses/{id}, .../input_items), /v1/messages (+ /count_tokens), /v1/models, /health,
/version, /tokenize,
/detokenize, /metrics, /dashboard, /stats. Every error is an OpenAI-shaped body: 400 for any
invalid input (schema, JSON, values, context length), 401 for a missing or wrong API key on /v1/*,
404 for an unknown model, 408 past ``request_timeout``, 413 for a body over
``max_request_body_bytes``, 503 (with ``Retry-After``) when the waiting queue is full or the
server is draining, 500 ``internal_error`` when the engine failed that one request. On the
Messages routes the same errors take Anthropic's shape (503 becomes 529 ``overloaded_error``).

Lifecycle: /health answers 503 once the engine loop has died; the runner then stops uvicorn and
``serve`` returns 1. On SIGTERM or SIGINT the server drains: every new request gets a 503, requests
in flight get ``shutdown_grace_seconds`` to finish, the rest are aborted with a 503 error, and
``serve`` returns 0.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType

from fastapi import FastAPI, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prefixserve.api.async_engine import RETRY_AFTER_SECONDS, AsyncEngine, EngineDeadError
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
from prefixserve.api.protocol_messages import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    is_messages_path,
)
from prefixserve.api.protocol_responses import ResponsesRequest
from prefixserve.api.responses_metrics import ResponsesCollector
from prefixserve.api.responses_store import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    ResponseStore,
)
from prefixserve.api.responses_websocket import serve_websocket
from prefixserve.api.serving_chat import ChatServing
from prefixserve.api.serving_completion import CompletionServing
from prefixserve.api.serving_messages import MessagesServing
from prefixserve.api.serving_responses import ResponsesServing
from starlette.exceptions import HTTPException as StarletteHTTPException

import prefixserve
from prefixserve.chat_template import CONTENT_FORMATS, render_chat
from prefixserve.engine import LLMEngine
from prefixserve.errors import CacheCapacityError, InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0


@dataclass
class ServerConfig:
    """Options of the HTTP layer (the engine's own live in ``EngineConfig``).

    ``max_waiting_requests``: engine requests allowed to wait for a slot before new ones get a 503.
    ``request_timeout``: seconds a request may spend in the engine before it is aborted with a 408
    (None: no limit). ``shutdown_grace_seconds``: how long a drain waits for requests in flight.
    ``require_cache_salt``: refuse requests without a ``cache_salt``.
    ``chat_template_content_format``: how message content reaches the chat template (``auto``,
    ``string``, ``openai``; see ``prefixserve.chat_template``).
    ``responses_store_*``: the bounds of the Responses store (entries, bytes, seconds).
    ``drop_attribution_header``: leave Claude Code's per-session attribution block out of
    Messages prompts (``api/messages_prompt.py``). ``messages_force_tool_call``: a testing aid
    (``MessagesServing``).
    """

    served_model_names: list[str]
    api_key: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_timeout: float | None = None
    shutdown_grace_seconds: float = DEFAULT_SHUTDOWN_GRACE_SECONDS
    require_cache_salt: bool = False
    chat_template_content_format: str = "auto"
    responses_store_max_entries: int = DEFAULT_MAX_ENTRIES
    responses_store_max_bytes: int = DEFAULT_MAX_BYTES
    responses_store_max_age_s: float = DEFAULT_MAX_AGE_S
    drop_attribution_header: bool = True
    messages_force_tool_call: dict | None = None

    def __post_init__(self) -> None:
        if self.max_waiting_requests < 1:
            raise InvalidArgumentError(
                f"max_waiting_requests: must be >= 1, got {self.max_waiting_requests}",
                "max_waiting_requests",
            )
        if self.max_request_body_bytes < 1:
            raise InvalidArgumentError(
                f"max_request_body_bytes: must be >= 1, got {self.max_request_body_bytes}",
                "max_request_body_bytes",
            )
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise InvalidArgumentError(
                f"request_timeout: must be > 0 seconds, got {self.request_timeout}",
                "request_timeout",
            )
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise InvalidArgumentError(
                f"chat_template_content_format: must be one of {CONTENT_FORMATS}",
                "chat_template_content_format",
            )
        if self.shutdown_grace_seconds < 0:
            raise InvalidArgumentError(
                f"shutdown_grace_seconds: must be >= 0, got {self.shutdown_grace_seconds}",
                "shutdown_grace_seconds",
            )


def _error_body(exc: APIError, path: str) -> tuple[int, dict]:
    """``(status, body)``: Anthropic's shape on the Messages routes, OpenAI's elsewhere."""
    if is_messages_path(path):
        return anthropic_error(exc)
    return exc.status, exc.body()


def _error(exc: APIError, path: str = "") -> JSONResponse:
    status, body = _error_body(exc, path)
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def _send_error(send, exc: APIError, path: str) -> None:
    """Answer a raw ASGI request with ``exc`` as a JSON error body."""
    status, content = _error_body(exc, path)
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """Pure ASGI middleware at the door: body size limit, refusal while draining, requests in flight.

    The body is read here, up to ``max_body_bytes`` (a larger ``Content-Length`` is refused before
    reading; a body that grows past the limit while streaming in is refused as soon as it does),
    and replayed to the app; later ``receive`` calls go to the client, so disconnects still show.
    """

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self.in_flight = 0

    def _too_large(self) -> APIError:
        return APIError(
            f"request body: larger than the server's limit of {self.max_body_bytes} bytes; "
            "send a smaller request",
            413,
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] != "/metrics":
            await _send_error(
                send,
                APIError(
                    "the server is shutting down and accepts no new requests; retry on another "
                    "replica or later",
                    503,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
                ),
                scope["path"],
            )
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, self._too_large(), scope["path"])
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large(), scope["path"])
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        self.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1


def _body_error_message(exc: BaseException | None) -> str:
    """Why a request body could not be parsed, and what to change."""
    if isinstance(exc, RecursionError):
        return "request body: the JSON is nested too deeply to parse; flatten it"
    if isinstance(exc, UnicodeDecodeError):
        return "request body: not valid UTF-8; send UTF-8 encoded JSON"
    return f"request body: could not be parsed as JSON ({exc!r}); send a JSON object"


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def _validation_param(exc: RequestValidationError) -> str | None:
    """The top-level field of the first error, as OpenAI's ``param``."""
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if loc and isinstance(loc[0], str):
            return loc[0]
    return None


def create_app(
    llm_engine: LLMEngine,
    config: ServerConfig,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """One app per engine, built with everything it serves: the engine thread
    (``app.state.engine``), its metrics and the handlers; no module-level state.
    ``served_model_names`` default to the model's own name."""
    names = config.served_model_names or [llm_engine.model_name]
    metrics = ServerMetrics(names[0])
    engine = AsyncEngine(
        llm_engine,
        observer=metrics.observe_step,
        max_waiting=config.max_waiting_requests,
        on_death=on_engine_death,
    )
    app = build_app(engine, config)
    app.state.metrics = metrics
    metrics.registry.register(ResponsesCollector(names[0], app.state.responses))

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(
            metrics.render(engine.snapshot()), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    app.include_router(dashboard_router(engine, metrics, app.state.responses.stats))
    return app


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The OpenAI API and the service routes over ``engine``: an ``AsyncEngine``, or an object
    with its interface (the scale-out ingress's ``RemoteEngine``). /metrics and /dashboard are
    the caller's to add: ``create_app`` serves one engine's, the ingress the cluster's."""
    names = config.served_model_names or [engine.model_name]
    options = dict(
        request_timeout=config.request_timeout, require_cache_salt=config.require_cache_salt
    )
    chat = ChatServing(
        engine, names, config.tool_call_parser, config.chat_template_content_format,
        reasoning_parser=config.reasoning_parser, **options,
    )  # fmt: skip
    completion = CompletionServing(engine, names, **options)
    store = ResponseStore(
        config.responses_store_max_entries,
        config.responses_store_max_bytes,
        config.responses_store_max_age_s,
    )
    responses = ResponsesServing(
        engine, names, config.tool_call_parser, store, config.chat_template_content_format,
        reasoning_parser=config.reasoning_parser, **options,
    )  # fmt: skip
    messages = MessagesServing(
        chat, config.drop_attribution_header, config.messages_force_tool_call
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="prefixserve", version=prefixserve.__version__, lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.state.responses = responses

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        return _error(
            APIError(_validation_message(exc), 400, _validation_param(exc)), request.url.path
        )

    async def on_engine_error(request: Request, exc: Exception):
        return _error(APIError(str(exc), 400, getattr(exc, "param", None)), request.url.path)

    async def on_engine_dead(request: Request, exc: Exception):
        return _error(APIError(str(exc), 500), request.url.path)

    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(InvalidArgumentError, on_engine_error)
    app.add_exception_handler(CacheCapacityError, on_engine_error)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.__cause__ is not None:
            return _error(APIError(_body_error_message(exc.__cause__), 400), request.url.path)
        if is_messages_path(request.url.path):
            return _error(APIError(str(exc.detail), exc.status_code), request.url.path)
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
            # OpenAI clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"
            x_api_key = request.headers.get("x-api-key")
            if x_api_key is not None:
                given, expected = x_api_key, config.api_key
            else:
                given, expected = (
                    request.headers.get("authorization", ""),
                    f"Bearer {config.api_key}",
                )
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return _error(
                    APIError("Unauthorized: a valid API key is required", 401), request.url.path
                )
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
                for name in names
            ]
        )

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        completion.check_model(model_id)
        return ModelCard(id=model_id, root=engine.model_name, max_model_len=engine.max_model_len)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request):
        return _respond(await chat.create(req, raw_request))

    @app.post("/v1/messages")
    async def create_message(req: MessagesRequest, raw_request: Request):
        return _respond(await messages.create(req, raw_request))

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(req: CountTokensRequest):
        return await messages.count_tokens(req)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request):
        return _respond(await completion.create(req, raw_request))

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request):
        return _respond(await responses.create(req, raw_request))

    @app.websocket("/v1/responses")
    async def responses_websocket(ws: WebSocket):
        await serve_websocket(ws, responses, config.api_key, config.max_request_body_bytes)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw_request: Request, cache_salt: str | None = None):
        return responses.lookup(raw_request.headers.get("authorization"), response_id,
                                cache_salt).response  # fmt: skip

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(
        response_id: str, raw_request: Request, cache_salt: str | None = None
    ):
        return responses.delete(raw_request.headers.get("authorization"), response_id, cache_salt)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, raw_request: Request, cache_salt: str | None = None, limit: int = 20,
        order: str = "desc", after: str | None = None,
    ):  # fmt: skip
        entry = responses.lookup(raw_request.headers.get("authorization"), response_id, cache_salt)
        return responses.input_items(entry, limit, order, after)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        completion.check_model(req.model)
        tok = engine.tokenizer
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                ids = await asyncio.to_thread(
                    render_chat, tok, req.messages, tools=tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    add_special_tokens=bool(req.add_special_tokens),
                    content_format=config.chat_template_content_format,
                    chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
                )  # fmt: skip
            except InvalidArgumentError as exc:
                raise APIError(str(exc), 400, exc.param) from exc
        elif req.prompt is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tok.encode(req.prompt, add_special_tokens=add)
        else:
            raise APIError("tokenize: give either 'prompt' or 'messages'", 400, "prompt")
        body = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}
        if req.return_token_strs:
            body["token_strs"] = tok.convert_ids_to_tokens(ids)
        return body

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

    app.add_middleware(Gate, max_body_bytes=config.max_request_body_bytes)
    return app


def gate_of(app: FastAPI) -> Gate:
    """The app's ``Gate`` middleware instance (built with the middleware stack on first use)."""
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    layer = app.middleware_stack
    while not isinstance(layer, Gate):
        layer = layer.app
    return layer


async def drain(app: FastAPI, grace_seconds: float) -> None:
    """Refuse new requests, give those in flight ``grace_seconds``, then abort the rest."""
    gate, engine = gate_of(app), app.state.engine
    gate.draining = True
    logger.info("draining: %d requests in flight, grace %.1f s", gate.in_flight, grace_seconds)
    deadline = time.monotonic() + grace_seconds
    while gate.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gate.in_flight:
        logger.warning("grace period over: aborting %d requests in flight", gate.in_flight)
        engine.fail_all(
            APIError("the server shut down before this request finished; retry it", 503)
        )
        deadline = time.monotonic() + 5.0
        while gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def _respond(result):
    if hasattr(result, "__aiter__"):
        return StreamingResponse(
            result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return result


def run_server(
    engine_kwargs: dict,
    host: str,
    port: int,
    config: ServerConfig,
    log_level: str,
    engine_hook: Callable | None = None,
) -> int:
    """Load the engine, serve until stopped; 1 if the engine loop died, else 0.

    ``engine_hook(llm_engine)`` runs once the engine is built (the CLI's fault injection uses it).
    """
    import uvicorn

    from prefixserve.config import EngineConfig

    llm_engine = LLMEngine(EngineConfig(**engine_kwargs))
    if engine_hook is not None:
        engine_hook(llm_engine)

    def on_death(exc: BaseException) -> None:
        logger.error("stopping the server: the engine loop died (%r)", exc)
        server.should_exit = True

    app = create_app(llm_engine, config, on_engine_death=on_death)
    engine = app.state.engine

    class DrainingServer(uvicorn.Server):
        """The first SIGTERM/SIGINT starts a drain and exits after it; a second SIGINT forces."""

        draining = False
        drain_task: asyncio.Task | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # A signal handler interrupts the loop mid-step: hand the work over thread-safely.
            if self.draining or self.should_exit:
                if sig == signal.SIGINT:
                    self.force_exit = self.should_exit = True
                return
            self.draining = True
            asyncio.get_running_loop().call_soon_threadsafe(self._start_drain)

        def _start_drain(self) -> None:
            self.drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            try:
                await drain(app, config.shutdown_grace_seconds)
            finally:
                self.should_exit = True

    server = DrainingServer(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    )

    logger.info("serving %s on http://%s:%d", llm_engine.model_name, host, port)
    server.run()
    return 1 if engine.dead is not None else 0
