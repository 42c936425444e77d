"""The FastAPI application: routes, API-key check, OpenAI-style error handlers.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's; all behind ``--api-key`` when set),
``GET /health`` (200 with queue counts when the engine serves, 503 otherwise, e.g. while the
engine process restarts), ``GET /metrics`` (Prometheus text). Each chat / completions request
gets one log line (:mod:`structspec.server.request_log`; tokenization requests, which generate
nothing, get none) and the engine's throughput and queues one line every few seconds
(:mod:`structspec.server.stats_log`), unless ``state.log_config`` turns them off.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from structspec.server.errors import APIError, error_body, server_error
from structspec.server.metrics import CONTENT_TYPE
from structspec.server.request_log import RequestLogMiddleware
from structspec.server.serving import ServerState, error_response, json_response
from structspec.server.serving_chat import create_chat_completion
from structspec.server.serving_completion import create_completion
from structspec.server.serving_tokenize import create_detokenize, create_tokenize
from structspec.server.stats_log import StatsLogger

logger = logging.getLogger("structspec.server")


def create_app(state: ServerState,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """Build the app around ``state``.

    Args:
        state: engine handle, codec, metrics, model name, API key.
        on_shutdown: awaited at lifespan shutdown (after in-flight requests ended), e.g. to
            stop the engine process.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.attach(asyncio.get_running_loop())
        state.engine.add_listener(state.metrics.on_engine_stats)
        state.metrics.ready.set(1 if state.engine.ready else 0)
        stats_task = None
        if state.log_config.log_stats:
            stats_log = StatsLogger(state.metrics, lambda: state.engine.stats,
                                    state.log_config.stats_interval_s)
            stats_task = asyncio.get_running_loop().create_task(stats_log.run())
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            state.metrics.ready.set(0)
            if on_shutdown is not None:
                await on_shutdown()

    app = FastAPI(title="structspec", version="0.1.0", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    if state.log_config.log_requests:
        # outside the exception handlers: the error responses they render pass through it
        app.add_middleware(RequestLogMiddleware)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc, state.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        state.metrics.on_http_error(exc.status_code)
        return json_response(error_body(str(exc.detail), type="invalid_request_error",
                                        code=str(exc.status_code)), exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client closed the connection before its whole request body arrived: not a
        # server fault, and nobody reads the reply. Counted under 499, nginx's "client closed
        # request" (it used to fall through to the handler below: a logged traceback and a
        # 500 in the error metrics).
        logger.info("client disconnected before sending its whole request body (%s %s)",
                    request.method, request.url.path)
        state.metrics.on_http_error(499)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(server_error(f"internal error: {type(exc).__name__}: {exc}"),
                              state.metrics)

    def check_auth(request: Request) -> None:
        """Raises: APIError 401 unless the request carries the API key (when one is set)."""
        if not state.api_key:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), state.api_key.encode()):
            raise APIError(401, "Incorrect API key provided." if token else
                           "Missing API key: send 'Authorization: Bearer <key>'.",
                           type="invalid_request_error", code="invalid_api_key")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        return await create_chat_completion(state, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        check_auth(request)
        return await create_completion(state, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        check_auth(request)
        return await create_tokenize(state, request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        check_auth(request)
        return await create_detokenize(state, request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        check_auth(request)
        info = state.engine.info
        return json_response({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": created,
            "owned_by": "structspec", "root": info.model_path,
            "max_model_len": info.max_model_len,
        }]})

    @app.get("/health")
    async def health() -> Response:
        engine = state.engine
        body: dict[str, object] = {"status": "ok" if engine.ready else "unavailable",
                                   **engine.stats.as_dict(),
                                   "num_inflight": getattr(engine, "num_inflight", 0),
                                   # engine supervision (server.supervisor): a 503 with
                                   # restarting true turns into a 200 once it is back
                                   "restarting": getattr(engine, "restarting", False),
                                   "engine_restarts": getattr(engine, "restarts", 0)}
        return json_response(body, 200 if engine.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.ready.set(1 if state.engine.ready else 0)
        state.metrics.inflight.set(getattr(state.engine, "num_inflight", 0))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app
