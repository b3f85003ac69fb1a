"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from core.types import CapacityError, HisparseError, InvalidRequestError, WorkerUnavailable

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code, self.retry_after = status, message, kind, param, code, retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, request_id: str | None = None) -> JSONResponse:
        headers = {}
        if self.status == 401:  # RFC 9110: a 401 names the scheme that would be accepted
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(round(self.retry_after))))
        if request_id:
            headers["X-Request-Id"] = request_id
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def from_exception(e: BaseException) -> ApiError:
    """Map anything raised while serving a request to the error a client should see."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, InvalidRequestError):
        return ApiError(400, str(e), e.kind, getattr(e, "param", None))
    if isinstance(e, CapacityError):
        return ApiError(503, str(e), e.kind, code="overloaded", retry_after=e.retry_after_s)
    if isinstance(e, WorkerUnavailable):
        return ApiError(503, str(e), e.kind, code="unavailable", retry_after=5)
    if isinstance(e, HisparseError):
        return ApiError(e.status, str(e), e.kind)
    log.exception("internal error while serving a request", exc_info=e)
    return ApiError(500, "internal error; the server logged the details", "internal_error")


def install(app) -> None:
    def rid(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return exc.response(rid(request))

    @app.exception_handler(HisparseError)  # core's refusals (a prompt check, a sampling range) raised in a route
    async def _ours(request: Request, exc: HisparseError):
        return from_exception(exc).response(rid(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = f"malformed request body: {first.get('msg', 'invalid')}" + (f" at {loc}" if loc else "")
        return ApiError(422, msg, "invalid_request_error", loc or None).response(rid(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        msg = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return ApiError(exc.status_code, msg, kind).response(rid(request))

    @app.exception_handler(Exception)
    async def _other(request: Request, exc: Exception):
        return from_exception(exc).response(rid(request))
