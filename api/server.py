"""The FastAPI app (``create_app``) and the uvicorn runner behind ``prefixserve serve``.

Routes: /v1/chat/completions, /v1/completions, /v1/responses (+ GET/DELETE
/v1/responses/{id}, .../input_items), /v1/messages (+ /count_tokens), /v1/models, /health,
/version, /tokenize,
/detokenize, /metrics, /dashboard, /stats. With API keys every route takes one but /health
(liveness) and the ``public_routes`` the operator names (never a /v1 route). Every error is an
OpenAI-shaped body: 400 for any invalid input (schema, JSON, values, context length), 401 for a
missing or wrong API key, 404 for an unknown model, 408 past ``request_timeout``, 413 for a body
over ``max_request_body_bytes``, 503 (with ``Retry-After``) when the waiting queue is full or the
server is draining, 500 ``internal_error`` when the engine failed that one request or the server
failed unexpectedly (``frontend.gate``: the connection stays open). On the Messages routes the
same errors take Anthropic's shape (503 becomes 529 ``overloaded_error``).

Lifecycle: /health answers 503 once the engine loop has died; the runner then stops uvicorn and
``serve`` returns 1. On SIGTERM or SIGINT the server drains: every new request gets a 503, requests
in flight get ``shutdown_grace_seconds`` to finish, the rest are aborted with a 503 error, and
``serve`` returns 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import FrameType

from fastapi import FastAPI
from fastapi.responses import Response

import prefixserve
from prefixserve.api.anthropic.messages import MessagesServing
from prefixserve.api.anthropic.protocol import anthropic_error
from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.dashboard import dashboard_router
from prefixserve.api.frontend.auth import install_authentication
from prefixserve.api.frontend.errors import ErrorShapes, install_error_handlers
from prefixserve.api.frontend.gate import Activity, Gate, drain
from prefixserve.api.frontend.tenancy import Tenants, key_tenants
from prefixserve.api.metrics import ServerMetrics
from prefixserve.api.openai.chat import ChatServing
from prefixserve.api.openai.completions import CompletionServing
from prefixserve.api.openai.responses.metrics import ResponsesCollector
from prefixserve.api.openai.responses.serving import ResponsesServing
from prefixserve.api.openai.responses.store import (
    DEFAULT_MAX_AGE_S,
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    IN_MEMORY,
    ResponseStore,
)
from prefixserve.api.openai.responses.tools import HOSTED_POLICIES
from prefixserve.api.openai.tokenization import TokenizationServing
from prefixserve.api.routes.generate import generation_router
from prefixserve.api.routes.kv import kv_router
from prefixserve.api.routes.responses import responses_router
from prefixserve.api.routes.service import service_router
from prefixserve.api.routes.tokenization import tokenization_router
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.engine.chat_template import CONTENT_FORMATS
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine.request_chat_template import TemplateLimits

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
    ``string``, ``openai``; see ``prefixserve.engine.chat_template``).
    ``responses_store_*``: the bounds of the Responses store (entries, bytes, seconds; per
    tenant: entries, bytes, None for the global bound) and its SQLite file (``:memory:``: none).
    ``api_key``, ``api_keys`` (key -> tenant name): the keys accepted on /v1 (``frontend.tenancy``);
    ``share_prefix_cache_across_tenants``: tenants share cached blocks (never stored responses).
    ``public_routes``: paths answered without a key (besides /health; no /v1 path).
    ``allow_client_chat_template``: accept a request's ``chat_template`` and render it under
    bounds (``prefixserve.engine.request_chat_template``); else it is a 400.
    ``hosted_tools``: ``accept`` (hosted Responses tools are not offered, and said so) or
    ``refuse`` (a 400). ``retain_tool_call_kv``: a reply that ends in a tool call keeps its KV
    for a learned TTL (``frontend.tool_call_retention``). ``drop_attribution_header``: leave Claude Code's per-session attribution block out of
    Messages prompts (``api/messages_prompt.py``). ``messages_force_tool_call``: a testing aid
    (``MessagesServing``).
    """

    served_model_names: list[str]
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    share_prefix_cache_across_tenants: bool = False
    public_routes: list[str] = field(default_factory=list)
    allow_client_chat_template: bool = False
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
    responses_store_tenant_max_entries: int | None = None
    responses_store_tenant_max_bytes: int | None = None
    responses_store_path: str = IN_MEMORY
    hosted_tools: str = "accept"
    retain_tool_call_kv: bool = True
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
        if self.hosted_tools not in HOSTED_POLICIES:
            raise InvalidArgumentError(
                f"hosted_tools: must be one of {HOSTED_POLICIES}", "hosted_tools"
            )
        for path in self.public_routes:
            if not path.startswith("/") or path == "/v1" or path.startswith("/v1/"):
                raise InvalidArgumentError(
                    f"public_routes: {path!r} must be a path like /metrics outside /v1 (the API "
                    "always takes the key)",
                    "public_routes",
                )
        if self.shutdown_grace_seconds < 0:
            raise InvalidArgumentError(
                f"shutdown_grace_seconds: must be >= 0, got {self.shutdown_grace_seconds}",
                "shutdown_grace_seconds",
            )


def create_app(
    llm_engine: LLMEngine | AsyncEngine,
    config: ServerConfig,
    on_engine_death: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """One app per engine, built with everything it serves: the engine thread
    (``app.state.engine``: ``llm_engine`` itself when it is an ``AsyncEngine`` not yet started,
    as ``run_server`` launches it), its metrics and the handlers; no module-level state.
    ``served_model_names`` default to the model's own name."""
    engine = llm_engine if isinstance(llm_engine, AsyncEngine) else AsyncEngine(llm_engine)
    names = config.served_model_names or [engine.model_name]
    metrics = ServerMetrics(names[0])
    engine.observer = metrics.observe_step
    engine.max_waiting = config.max_waiting_requests
    engine.on_death = on_engine_death
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
    tenants = Tenants({**key_tenants([config.api_key or ""]), **config.api_keys},
                      config.share_prefix_cache_across_tenants)  # fmt: skip
    options = dict(
        request_timeout=config.request_timeout, require_cache_salt=config.require_cache_salt
    )
    limits = TemplateLimits.of_server(config.max_request_body_bytes, engine.max_model_len)
    template = dict(
        tool_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
        content_format=config.chat_template_content_format,
        retain_tool_calls=config.retain_tool_call_kv,
        template_limits=limits if config.allow_client_chat_template else None, **options,
    )  # fmt: skip
    chat = ChatServing(engine, names, **template)
    completion = CompletionServing(engine, names, **options)
    store = ResponseStore(
        config.responses_store_max_entries,
        config.responses_store_max_bytes,
        config.responses_store_max_age_s,
        config.responses_store_tenant_max_entries,
        config.responses_store_tenant_max_bytes,
        config.responses_store_path,
    )
    responses = ResponsesServing(engine, names, store, config.hosted_tools, **template)
    messages = MessagesServing(engine, names, config.drop_attribution_header,
                               config.messages_force_tool_call, **template)  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)
            await asyncio.to_thread(store.close)

    app = FastAPI(title="prefixserve", version=prefixserve.__version__, lifespan=lifespan)
    activity = Activity()
    app.state.engine, app.state.config, app.state.tenants = engine, config, tenants
    app.state.activity, app.state.responses = activity, responses
    shapes = ErrorShapes((("/v1/messages", anthropic_error),))  # Anthropic's own error shape
    install_error_handlers(app, shapes)
    install_authentication(app, tenants, {"/health", *config.public_routes}, shapes)
    for router in (
        service_router(engine, names, completion.check_model),
        generation_router(chat, completion, responses, messages),
        responses_router(responses, tenants, activity, config.max_request_body_bytes),
        kv_router(engine),
        tokenization_router(TokenizationServing(chat)),
    ):
        app.include_router(router)
    app.add_middleware(Gate, max_body_bytes=config.max_request_body_bytes, activity=activity,
                       shapes=shapes)  # fmt: skip
    return app


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

    from prefixserve.core.config import EngineConfig

    # built on the thread that will step it (AsyncEngine.launch: one OpenMP team)
    engine = AsyncEngine.launch(lambda: LLMEngine(EngineConfig(**engine_kwargs)))
    llm_engine = engine.engine
    if engine_hook is not None:
        engine_hook(llm_engine)

    def on_death(exc: BaseException) -> None:
        logger.error("stopping the server: the engine loop died (%r)", exc)
        server.should_exit = True

    app = create_app(engine, config, on_engine_death=on_death)

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
