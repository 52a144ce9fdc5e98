"""ASGI middleware of the HTTP API: bearer-token auth and the request body limit, and the count of
answers by endpoint and status (sala_requests).

Only requests that reach one of the guarded routes pass through it: an unknown path or method
is answered 404 / 405 by routing as before (auth or not), and /health and /metrics stay open.
"""
from __future__ import annotations

import hmac
from typing import Callable

from starlette.routing import Match, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import APIError


class Guard:
    """For a request to a route named in `guarded` (the route's name is its endpoint): with
    `api_key` set, `Authorization: Bearer KEY` or a 401; a body over `max_body_bytes` raises a
    413 APIError in whoever reads it (a route that never reads its body never sees it); every
    answer counted by `count(endpoint, status)`."""

    def __init__(self, app: ASGIApp, *, router: Router, guarded: set[str], api_key: str | None, max_body_bytes: int,
                 count: Callable[[str, int], None]):
        self.app, self.router, self.guarded = app, router, guarded
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes, self.count = max_body_bytes, count

    def endpoint(self, scope: Scope) -> str | None:
        for route in self.router.routes:
            if route.matches(scope)[0] is Match.FULL:
                return route.name if route.name in self.guarded else None
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoint(scope) if scope["type"] == "http" else None
        if endpoint is None:
            return await self.app(scope, receive, send)

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.count(endpoint, message["status"])
            await send(message)

        # As bytes: a header holding non-ASCII (the server sees it as latin-1) is a wrong key, not a crash.
        if self.key and not hmac.compare_digest(header(scope, b"authorization"), self.key):
            return await APIError(401, "Incorrect API key provided", code="invalid_api_key").response()(scope, receive, counted)
        too_large = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        length = header(scope, b"content-length")
        declared = int(length) if length.isdigit() else 0
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            if declared > self.max_body_bytes:
                raise too_large
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise too_large
            return message

        await self.app(scope, limited, counted)


def header(scope: Scope, name: bytes) -> bytes:
    """The first value of header `name` (lower case), as Starlette's Request.headers reads it; b"" if none."""
    return next((v for k, v in scope["headers"] if k == name), b"")
