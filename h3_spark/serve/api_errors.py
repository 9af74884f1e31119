"""The shape of a refusal: `{"error": "..."}` on the service's own routes, and OpenAI's
`{"error": {"message", "type", "param", "code"}}` on the `/v1/` routes, whose clients (the openai package, LiteLLM)
read that object. Every refusal goes through `error_response`, middleware's included, so one route family never
answers in the other's shape."""

from __future__ import annotations

from starlette.responses import JSONResponse

OPENAI_PREFIX = "/v1/"

# What OpenAI's clients read from `type` and `code`: the kind of failure, and a stable word for it.
_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
_CODES = {400: "invalid_value", 401: "invalid_api_key", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
          408: "request_timeout", 409: "conflict", 413: "too_large", 415: "unsupported_media_type",
          429: "queue_full", 431: "headers_too_large", 500: "internal_error", 501: "not_implemented",
          503: "not_ready"}


def is_openai(path: str) -> bool:
    return path.startswith(OPENAI_PREFIX)


def error_body(path: str, status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    if not is_openai(path):
        return {"error": message}
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or _CODES.get(status)}}


def error_response(path: str, status: int, message: str, headers: dict | None = None, *, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, param=param, code=code), status_code=status,
                        headers=headers or None)
