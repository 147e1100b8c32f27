"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`.

Every failure the server answers goes through `error_response`, so clients written for OpenAI
(the official `openai` package raises `BadRequestError`, `NotFoundError`, ... from these) see the
same shapes and status codes.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

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
