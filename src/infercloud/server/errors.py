"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server answers goes through `error_response`, so clients written for OpenAI
(the official `openai` package raises `BadRequestError`, `NotFoundError`, ... from these) see the
same shapes and status codes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers: dict[str, str] = {}
        """Extra response headers (the gateway's refusals: Retry-After, x-ratelimit-*)."""


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


def api_error_response(exc: APIError) -> JSONResponse:
    """The answer to an `APIError`: its OpenAI error body, status and extra headers."""
    response = error_response(exc.status, exc.message, param=exc.param, code=exc.code)
    response.headers.update(exc.headers)
    return response


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code) for a request body that failed validation."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return "request body is not valid JSON", None, "invalid_json"
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
        for e in errors
    )
    return message, ".".join(loc) or None, None


def install_error_handlers(
    app: FastAPI,
    on_invalid: Callable[[Request, str], Awaitable[None]] | None = None,
) -> None:
    """Answer `APIError`, validation errors and routing errors (404, 405) in OpenAI's format.

    `on_invalid(request, message)`, if given, is awaited for each body that fails validation.
    """

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = validation_message(exc)
        if on_invalid is not None:
            await on_invalid(request, message)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))


class BodyLimitMiddleware:
    """Answer 413 to a body over the limit (pure ASGI): at once when its declared length is
    over, and as soon as the bytes received pass it when it has none (chunked), so that no
    body is read past the limit either way.

    `on_refuse(scope, status, message)`, if given, is awaited first (the gateway records it).
    A chunked body's refusal is raised from `receive` as an `HTTPException` (413), which
    FastAPI passes on to the app's handler (it turns other errors while reading a body into
    400s).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int,
        on_refuse: Callable[[Scope, int, str], Awaitable[None]] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = False
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit():
                declared = True
                if int(value) > self.max_body_bytes:
                    message = (
                        f"request body of {int(value)} bytes exceeds the limit of "
                        f"{self.max_body_bytes}"
                    )
                    if self.on_refuse is not None:
                        await self.on_refuse(scope, 413, message)
                    await error_response(413, message)(scope, receive, send)
                    return
        if declared:  # the server holds the body to its declared length
            await self.app(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    text = f"request body exceeds the limit of {self.max_body_bytes} bytes"
                    if self.on_refuse is not None:
                        await self.on_refuse(scope, 413, text)
                    raise StarletteHTTPException(413, text)
            return message

        await self.app(scope, limited, send)
