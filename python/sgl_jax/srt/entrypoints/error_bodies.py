"""The JSON body of an HTTP error, in the shape of the API the path belongs to (one place for all of them).

- ``/v1/messages*`` (Anthropic's Messages API): ``{"type": "error", "error": {"type", "message"}}`` with
  Anthropic's error types (https://docs.anthropic.com/en/api/errors).
- ``/api/*`` (Ollama's API): ``{"error": "<message>"}`` (Ollama's server answers so).
- other ``/v1/*`` (OpenAI's API): OpenAI's ``{"error": {"message", "type", "param", "code"}}``
  (https://platform.openai.com/docs/guides/error-codes) with OpenAI's ``type`` values, ``param`` naming the
  field and ``code`` the HTTP status (vLLM's choice), plus SGLang's top-level ``object: "error"``, ``message``,
  ``type``, ``param``, ``code`` beside it, so SGLang's own clients read what they always read.
- elsewhere (SGLang's native API): ``{"error": {"message", "code"}}``.
"""

from __future__ import annotations

from typing import Optional

# OpenAI's error types by HTTP status (the official SDKs map the status to their exception class and show the
# body's error.message)
OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                      413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
                      429: "rate_limit_error"}
# SGLang's ErrorResponse.type values (its OpenAI server names the HTTP status)
SGLANG_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                      405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
                      500: "InternalServerError", 503: "ServiceUnavailableError"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                         415: "invalid_request_error", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}


def api_of(path: str) -> str:
    """Which API a request path belongs to: "anthropic", "ollama", "openai" or "native"."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/"):
        return "openai"
    return "native"


def openai_error_body(message: str, status_code: int, param: Optional[str] = None) -> dict:
    """OpenAI's error object with SGLang's top-level fields beside it (see the module docstring)."""
    kind = OPENAI_ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code},
            "object": "error", "message": message, "type": SGLANG_ERROR_TYPES.get(status_code, "Error"),
            "param": param, "code": status_code}


def anthropic_error_body(message: str, status_code: int) -> dict:
    """Anthropic's error object."""
    kind = ANTHROPIC_ERROR_TYPES.get(status_code, "api_error" if status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, message: str, status_code: int, param: Optional[str] = None) -> dict:
    """The error body for a request to `path` (see the module docstring).

    Args:
        message: one line saying what is wrong, naming the field.
        status_code: the HTTP status (4xx / 5xx).
        param: the request field at fault (OpenAI's ``param``), when one is.
    """
    api = api_of(path)
    if api == "anthropic":
        return anthropic_error_body(message, status_code)
    if api == "ollama":
        return {"error": message}
    if api == "openai":
        return openai_error_body(message, status_code, param)
    return {"error": {"message": message, "code": status_code}}
