"""OpenAI-style errors: one exception type carrying status, message and the offending field."""

from __future__ import annotations

from engine.http.openai.protocol import ErrorBody, ErrorDetail, encode
from engine.request.outputs import EngineError

_TYPE_BY_STATUS = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("invalid_request_error", "permission_denied"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
}

# What a client is told of a failure of the server's own: the details may describe internals.
INTERNAL_ERROR_MESSAGE = "internal server error; the server log has the details"

# The `outcome` label of engine_requests_total for each error status.
_OUTCOME_BY_STATUS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    413: "too_large",
    429: "rejected",
    503: "unavailable",
    499: "aborted",  # the client left before its answer (or its body) was whole
}


class ApiError(Exception):
    """An error to return as `{"error": {...}}` with this HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        default_type, default_code = _TYPE_BY_STATUS.get(status, ("server_error", None))
        self.type = default_type
        self.code = code if code is not None else default_code
        self.headers = headers or {}

    def body(self) -> ErrorBody:
        return ErrorBody(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        )

    def encoded(self) -> bytes:
        return encode(self.body())


def required(where: str, name: str, value: str | None) -> str:
    """`value`, or a 400 naming `where.name` as required (fields an API's schema leaves optional
    but one of its forms needs)."""
    if value is None:
        raise ApiError(400, f"'{where}.{name}' is required", param=f"{where}.{name}")
    return value


def outcome_of(status: int) -> str:
    return _OUTCOME_BY_STATUS.get(status, "error")


def api_error_from(error: EngineError) -> ApiError:
    """An engine's refusal as the API's error; a 429 or 503 says when to retry (Retry-After:
    the refusal's own figure, 1 s for a 429 that has none)."""
    retry_after = error.retry_after or (1 if error.status == 429 else None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return ApiError(error.status, error.message, param=error.param, headers=headers)
