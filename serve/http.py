"""The HTTP API: a thin layer over SalaServer's methods (the same a DeploymentHandle calls).

Each route reads its JSON body into the request model, calls its server method,
and answers the response object as JSON, or the stream of them as server-sent events ending
with `[DONE]`. A refused request is an OpenAI-style JSON error (serve/errors.py) with its
status; a full queue a 503 with Retry-After; a failure of ours a 500, or once a stream's 200
has gone, an error event in-band. Auth and the body limit are middleware (serve/middleware.py).
"""
from __future__ import annotations

import inspect
import json
import logging
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import TaskCancelledError
from starlette.exceptions import HTTPException

from sala.engine import QueueFull
from serve.errors import APIError, error_body, parse
from serve.middleware import Guard
from serve.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)

log = logging.getLogger("sala.serve")

def routes(server) -> tuple:
    """(method, path, endpoint: the route's name, as metrics and the Guard know it, the server method
    it calls, request model or None: no body). completions, chat and generate are async generators
    of response objects, taking the prefix router's prompt key."""
    return (
        ("GET", "/v1/models", "models", server.models, None),
        ("POST", "/v1/completions", "completions", server.completions, CompletionRequest),
        ("POST", "/v1/chat/completions", "chat", server.chat, ChatCompletionRequest),
        ("POST", "/generate", "generate", server.generate, GenerateRequest),
        ("POST", "/abort_request", "abort", server.abort, AbortRequest),
        ("POST", "/flush_cache", "flush_cache", server.flush_cache, None),
        ("GET", "/get_model_info", "model_info", server.model_info, None),
        ("GET", "/get_server_info", "server_info", server.server_info, None),
        ("POST", "/tokenize", "tokenize", server.tokenize, TokenizeRequest),
        ("POST", "/v1/tokenize", "tokenize", server.tokenize, TokenizeRequest),
        ("POST", "/detokenize", "detokenize", server.detokenize, DetokenizeRequest),
        ("POST", "/v1/detokenize", "detokenize", server.detokenize, DetokenizeRequest),
    )


def build_api(server, api_key: str | None, max_body_bytes: int) -> FastAPI:
    """The FastAPI app of `server` (a SalaServer; the routes use it only when called)."""
    api = FastAPI(title="sala", docs_url=None, redoc_url=None)
    api.add_exception_handler(HTTPException, routing_error)

    @api.get("/health")
    async def health() -> Response:
        try:
            server.check_health()
        except RuntimeError:
            return JSONResponse({"status": "engine stopped"}, 503)
        return JSONResponse({"status": "ok"})

    @api.get("/metrics")
    async def metrics() -> Response:
        return Response(await server.prometheus(), media_type=CONTENT_TYPE_LATEST)

    table = routes(server)
    for method, path, endpoint, call, model in table:
        api.add_api_route(path, route(endpoint, call, model), methods=[method], name=endpoint)
    api.add_middleware(Guard, router=api.router, guarded={endpoint for _, _, endpoint, _, _ in table}, api_key=api_key,
                       max_body_bytes=max_body_bytes,
                       count=lambda endpoint, status: server.metrics.requests.labels(endpoint, str(status)).inc())
    return api


def route(endpoint: str, call: Callable, model):
    generating = inspect.isasyncgenfunction(call)

    async def handle(request: Request) -> Response:
        body = None
        try:
            args = [body := parse(model, await read_json(request))] if model else []
            if not generating:
                return JSONResponse(await call(*args))
            # The key PrefixRoutingIngress routed this request by, when it came through SalaServer.routed.
            outputs = call(*args, prompt_key=getattr(request.state, "prompt_key", None))
            first = await anext(outputs)  # a refused request raises here, before any 200
            if not body.stream:
                await outputs.aclose()
                return JSONResponse(first)
        except QueueFull as e:
            return APIError(503, f"server busy: {e}", "server_error", code="queue_full", headers={"Retry-After": "1"}).response()
        except APIError as e:
            return e.response()
        except Exception:
            log.exception("request to %s failed", endpoint)
            return APIError(500, "internal server error", "server_error").response()
        return EventStream(events(first, outputs), media_type="text/event-stream")

    return handle


async def read_json(request: Request):
    body = await request.body()  # a body over the limit raises its 413 here (Guard)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None


async def routing_error(request: Request, e: HTTPException) -> JSONResponse:
    """Routing errors (an unknown path, a wrong method) in the same JSON shape as every other error."""
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return APIError(e.status_code, message.get(e.status_code, str(e.detail)), headers=getattr(e, "headers", None)).response()


def sse(payload: dict | list | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def events(first, rest: AsyncIterator) -> AsyncIterator[str]:
    try:
        yield sse(first)
        async for item in rest:
            yield sse(item)
    except Exception as e:  # after the 200 has gone out: report in-band, then end the stream
        log.exception("stream failed")
        yield sse(error_body(str(e), "server_error"))
    finally:
        await rest.aclose()  # a client that left: its requests are cancelled now, not when the generator is collected
    yield sse("[DONE]")


class EventStream(StreamingResponse):
    """An SSE response that takes Serve's word for a disconnect. Under Serve, `receive()` raises
    TaskCancelledError when the client has gone instead of returning `http.disconnect`; raised
    from starlette's disconnect listener, it would end the request with an exception that nobody
    retrieves: a "Future exception was never retrieved" traceback in the replica log for every
    client that leaves. A client leaving is normal: Serve logs its one line, the stream stops."""

    async def listen_for_disconnect(self, receive) -> None:
        try:
            await super().listen_for_disconnect(receive)
        except TaskCancelledError:
            pass
