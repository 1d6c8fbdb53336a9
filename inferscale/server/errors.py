"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with a matching status.

`APIError` is what the routes raise; `install_error_handlers` makes FastAPI's own errors (a body
that is not JSON or does not fit the schema: 422 by default; unknown routes; wrong methods) and
any unexpected exception come out in the same shape. Bad input is 400, never 422.

A 500 names no internals: the exception is logged with a request id, and the body (and the
`x-request-id` header) carries only that id (`internal_error`). No exception leaves the app
while a response can still be sent (`CatchErrors`), so the server never drops the connection
after an error: a client's next request on it is served.
"""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferscale.memory.service_types import UnknownFactError, UnknownUserError
from inferscale.memory.quotas import QuotaExceeded

log = logging.getLogger("inferscale.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error", 499: "client_closed_request", 500: "server_error",
         503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape. Strings are made encodable (a lone surrogate from the request, quoted
    back in a message, becomes `\\ud800`), so an error about bad input is never itself a 500."""
    return {"error": {"message": _printable(message), "type": TYPES.get(status, "server_error"),
                      "param": _printable(param), "code": code}}


def _printable(s: str | None) -> str | None:
    return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request")


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, param=param, code="not_found")


def too_large(message: str, param: str | None = None) -> APIError:
    return APIError(413, message, param=param, code="request_too_large")


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit: FastAPI re-raises HTTP
    exceptions met while reading a body (others become a generic 400), so this reaches the 413
    handler below whichever route was reading."""

    code = "request_too_large"
    HEADERS = {"Connection": "close"}  # uvicorn then closes the connection: the rest is never read

    def __init__(self, limit: int) -> None:
        super().__init__(413, body_too_large_message(limit), headers=dict(self.HEADERS))


def body_too_large_message(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes (max_body_bytes)"


def from_memory_error(e: BaseException) -> APIError:
    """The memory service's exceptions as HTTP errors (unknown user/fact: 404; bad input: 400)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (UnknownUserError, UnknownFactError)):
        return not_found(str(e))
    if isinstance(e, QuotaExceeded):
        return APIError(413, f"quota exceeded: {e}", param=e.limit, code="quota_exceeded")
    if isinstance(e, ValueError) or is_client_error(e):
        return bad_request(str(e))
    return internal_error(e, "memory operation failed")


def internal_error(e: BaseException, what: str) -> APIError:
    """A 500 that names no internals: `e` is logged (`what`, with a new request id) and the body
    says only the request id (also the `x-request-id` header)."""
    rid = "req-" + secrets.token_hex(8)
    log.error("%s (request id %s)", what, rid, exc_info=e)
    return APIError(500, f"internal error (request id {rid}; the server's log has the cause)", code="internal_error",
                    headers={"x-request-id": rid})


class TrackStart:
    """An ASGI `send` that remembers whether the response has started (after which a middleware
    can no longer answer with a response of its own)."""

    def __init__(self, send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self.send(message)


class CatchErrors:
    """Pure ASGI middleware, inside the others: an exception no handler took becomes the JSON 500
    of `internal_error` instead of leaving the app (uvicorn would then close the connection).
    HTTP exceptions (`BodyTooLarge`) pass on to the middleware that answers them, and so does an
    exception raised after the response started (nothing else can be sent)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = TrackStart(send)
        try:
            await self.app(scope, receive, tracked)
        except StarletteHTTPException:
            raise
        except Exception as e:  # noqa: BLE001 - answered as a 500
            if tracked.started:
                raise
            what = f"unhandled error on {scope.get('method')} {scope.get('path')}"
            await internal_error(e, what).response()(scope, receive, send)


def is_client_error(e: BaseException) -> bool:
    """vLLM's request validation errors (`VLLMClientError`), without importing vllm."""
    return any(c.__name__ == "VLLMClientError" for c in type(e).__mro__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
        if param is None and where:
            param = where
        msg = err.get("msg", "invalid value")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(400, message, param, "invalid_request"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return JSONResponse(error_body(exc.status_code, message, code=getattr(exc, "code", None)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, f"unhandled error on {request.method} {request.url.path}").response()
