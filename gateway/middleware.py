"""What every HTTP request passes before the app sees it: the API key, then the body's size.

A pure ASGI middleware, so that both checks happen before anything parses the body: a
request without a valid key gets 401 and reaches nothing downstream; a body over the limit
gets 413, whether its Content-Length says so or its bytes do (chunked uploads, or a header
that lies). The app then receives the whole body in one message. A body over the limit is
read and dropped before the 413 goes out, up to `DRAIN_BYTES` (or twice the limit, when that
is more), because a client that sends its whole body before it reads (Python's http.client,
curl without `Expect`) would otherwise see the connection reset instead of the answer.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from gateway.config import ApiKey
from gateway.errors import error_body
from gateway.ratelimit import key_id, key_salt

# Readable without a key: probes, scrapers and the API's own description.
OPEN_PATHS = frozenset(
    {"/health", "/version", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/dashboard"}
)  # the page holds no data

Scope = dict[str, Any]
# how much of a body over the limit is read (and dropped) so that its client reads the 413;
# beyond it the connection is closed at once (costs time and bandwidth, never memory)
DRAIN_BYTES = 64 * 1024 * 1024


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class GatewayMiddleware:
    """Authenticates (when keys are configured) and bounds the body.

    The request's key grant, when there is one, is left in `request.state.api_key`.
    """

    def __init__(
        self,
        app: Any,
        api_keys: Mapping[str, ApiKey],
        max_body_bytes: int,
        on_refused: Callable[[int], None] | None = None,
        metrics_require_key: bool = False,
    ) -> None:
        self.app = app
        self._open_paths = OPEN_PATHS - {"/metrics"} if metrics_require_key else OPEN_PATHS
        # looked up by digest, so that no comparison of the secret itself leaks its length
        # or prefix through timing
        self._keys = {_digest(key): grant for key, grant in api_keys.items()}
        self._salt = key_salt(api_keys)
        self.max_body_bytes = max_body_bytes
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self._keys and scope["path"] not in self._open_paths:
            if sum(1 for k, _ in scope["headers"] if k.lower() == b"authorization") > 1:
                # one key per request: two could authenticate one and be charged to another
                await self._refuse(send, 400, "more than one Authorization header", "invalid_request")
                return
            grant = self._authenticate(headers.get("authorization", ""))
            if grant is None:
                missing = not headers.get("authorization")
                await self._refuse(
                    send,
                    401,
                    "no API key: send the header 'Authorization: Bearer <key>'"
                    if missing
                    else "the API key is not valid",
                    "invalid_api_key",
                    {"www-authenticate": "Bearer"},
                )
                return
            state = scope.setdefault("state", {})
            state["api_key"] = grant
            # the rate-limit bucket of the key that was authenticated
            state["api_key_id"] = key_id(_token(headers.get("authorization", "")), self._salt)
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            await self._refuse(send, 400, "the Content-Length header is not a number", "invalid_content_length")
            return
        too_large = declared is not None and int(declared) > self.max_body_bytes
        drained = max(DRAIN_BYTES, 2 * self.max_body_bytes)
        if too_large and (int(declared) > drained or "100-continue" in headers.get("expect", "").lower()):
            await self._refuse_size(send)  # before the client sends it (or most of it)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: no one to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > self.max_body_bytes
            if too_large:
                # Nothing of it is kept. Up to `drained` bytes are read and dropped before
                # answering, so that a client still sending gets to read the 413 instead of
                # a connection reset; beyond that the connection is just closed.
                chunks.clear()
                if size > drained:
                    break
            else:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if too_large:
            await self._refuse_size(send)
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the body is done: what follows is the disconnect

        await self.app(scope, replay, send)

    def _authenticate(self, authorization: str) -> ApiKey | None:
        token = _token(authorization)
        return None if token is None else self._keys.get(_digest(token))

    async def _refuse_size(self, send: Any) -> None:
        await self._refuse(
            send, 413, f"the request body is larger than the limit of {self.max_body_bytes} bytes", "request_too_large"
        )

    async def _refuse(
        self, send: Any, status: int, message: str, code: str, extra_headers: Mapping[str, str] | None = None
    ) -> None:
        if self._on_refused is not None:
            self._on_refused(status)
        payload = json.dumps(error_body(status, message, None, code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
        ]
        headers += [(k.encode(), v.encode()) for k, v in (extra_headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _token(authorization: str) -> str | None:
    """The key of an `Authorization: Bearer <key>` header; None when there is none."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
