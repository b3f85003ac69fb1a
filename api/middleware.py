"""ASGI middleware that runs before any route: the request id, the API key, the body size limit; and
the access log's redaction of keys sent in a query string.

Plain ASGI (not Starlette's BaseHTTPMiddleware), so streaming responses pass through untouched and a
refused request costs no body parsing.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from urllib.parse import unquote_plus

from api.errors import ApiError

MAX_REQUEST_ID = 128
_UNSAFE = re.compile(r"[^A-Za-z0-9._:/+=@-]")
OPEN_PATHS = ("/health", "/metrics")
"""Routes that stay open with an API key set (probes and scrapers)."""
SECRET_QUERY_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "access_token", "token"})
"""Query parameters whose values are never logged. Keys are only read from `Authorization`, but clients
send them in the URL anyway, and the access log writes every URL."""


def clean_request_id(raw: str | None) -> str:
    """A client's X-Request-Id made safe to echo and log (at most 128 of a restricted set of characters);
    a fresh id when none (or nothing usable) was sent."""
    if raw:
        cleaned = _UNSAFE.sub("", raw)[:MAX_REQUEST_ID]
        if cleaned:
            return cleaned
    return uuid.uuid4().hex


def query_secret_names(query: str) -> list[str]:
    """The secret-looking parameter names in a query string (as sent)."""
    pairs = (p.partition("=") for p in query.split("&"))
    return [name for name, eq, _ in pairs if eq and unquote_plus(name).lower() in SECRET_QUERY_PARAMS]


def redact_query(target: str) -> str:
    """`path?query` with the value of every secret-looking parameter written as `***`."""
    path, sep, query = target.partition("?")
    if not sep:
        return target
    secret = set(query_secret_names(query))
    return path + "?" + "&".join(f"{p.partition('=')[0]}=***" if p.partition("=")[0] in secret else p for p in query.split("&"))


class RedactedAccessLog(logging.Filter):
    """Rewrites the request target of every access-log record (uvicorn passes it as an argument) before
    any handler formats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) and "?" in a else a for a in record.args)
        return True


def redact_access_log(name: str = "uvicorn.access") -> None:
    """Install the redaction on the access logger (once per process; called when the app starts, after
    uvicorn has configured its loggers)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactedAccessLog) for f in logger.filters):
        logger.addFilter(RedactedAccessLog())


def bearer_matches(header: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>` compared in constant time."""
    if not header or not header.lower().startswith("bearer "):
        return False
    return hmac.compare_digest(header[7:].strip().encode(), key.encode())


class GatewayMiddleware:
    """Tags every request with a clean request id (echoed in `X-Request-Id`), checks the API key on every
    route but the open ones (401), and refuses bodies over `max_body_bytes` (413) before they are read."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        rid = clean_request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*[(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"],
                                      (b"x-request-id", rid.encode())]
            await send(message)

        if self.api_key and not scope["path"].startswith(OPEN_PATHS) and not bearer_matches(headers.get("authorization"), self.api_key):
            msg = "missing or wrong API key: send `Authorization: Bearer <key>`"
            if query_secret_names(scope.get("query_string", b"").decode("latin-1")):
                msg += " (a key in the query string is not read: URLs end up in logs)"
            err = ApiError(401, msg, "authentication_error", code="invalid_api_key")
            return await err.response(rid)(scope, receive, send_with_id)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._too_large(rid)(scope, receive, send_with_id)

        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # read the body here (the routes read it whole anyway), so a chunked body that grows too large
            # is refused with 413 before anything parses it
            chunks, seen = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left before sending its body
                chunks.append(message.get("body", b""))
                seen += len(chunks[-1])
                if seen > self.max_body_bytes:
                    return await self._too_large(rid)(scope, receive, send_with_id)
                if not message.get("more_body", False):
                    break
            body, replayed = b"".join(chunks), False

            async def replay():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # after the body: disconnect notices

            return await self.app(scope, replay, send_with_id)
        await self.app(scope, receive, send_with_id)

    def _too_large(self, rid: str):
        return ApiError(413, f"request body larger than {self.max_body_bytes} bytes (--max-body-bytes)",
                        "invalid_request_error", code="request_too_large").response(rid)
