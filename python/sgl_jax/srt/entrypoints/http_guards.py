"""What every HTTP request passes before a route sees it: the API key and the JSON content type (and HEAD,
answered as a GET without its body).

- API keys (SGLang's ``--api-key`` and ``--admin-api-key`` and its auth levels), sent as
  ``Authorization: Bearer KEY`` or, as Anthropic's clients send it, ``x-api-key: KEY``: with ``--api-key``
  every endpoint but ``/health*`` and ``/metrics`` requires it (401 otherwise). Admin endpoints (``/flush_cache``,
  ``/abort_request``, ...: SGLang's ADMIN_OPTIONAL level, marked on their routes with `admin_endpoint`) require ``--admin-api-key`` when that is set (``--api-key`` is then refused there),
  else ``--api-key`` when that is set, else nothing. As upstream, the admin key does not open the ordinary
  endpoints. Keys are compared in constant time.
- ``POST``/``PUT`` bodies must be sent as ``Content-Type: application/json`` (415 otherwise). Browsers send
  cross-site "simple" requests (text/plain, form encodings) without a CORS preflight; refusing them keeps
  any web page the user opens from driving a server on localhost.

  The exception: a POST with no body at all to an endpoint that takes none (marked on its route with
  `bodyless_endpoint`: ``/flush_cache``, which sglang-router posts without a content type,
  ``/v1/responses/{id}/cancel``, and the ones that only undo or end something): without an admin or API
  key set, a web page can at most flush the prefix cache (a cost in speed, never in output) or try to cancel
  a stored response (which answers 400: there are no background responses to cancel).

- Bodies larger than ``--max-request-body-bytes`` get 413: at once when Content-Length says so, else as
  soon as the streamed body passes the limit (the route's body read raises `BodyTooLarge`, an HTTP 413
  exception the app's handler answers).
"""

from __future__ import annotations

import email.message
import hmac
from typing import Optional

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from sgl_jax.srt.entrypoints.error_bodies import error_body

PUBLIC_PREFIXES = ("/health", "/metrics")  # SGLang's exemptions (/health_generate included)
ADMIN_MARK = "admin_endpoint"  # the attribute `admin_endpoint` sets on a route's endpoint function
BODYLESS_MARK = "bodyless_endpoint"  # the attribute `bodyless_endpoint` sets


def admin_endpoint(endpoint):
    """Route decorator, written below ``@router.post(...)``: the route is an admin endpoint (SGLang's
    ADMIN_OPTIONAL level: it takes ``--admin-api-key`` when that is set, else ``--api-key``)."""
    setattr(endpoint, ADMIN_MARK, True)
    return endpoint


def bodyless_endpoint(endpoint):
    """Route decorator, written below ``@router.post(...)``: a POST endpoint that takes an empty body without a
    content type. Only for endpoints that undo or end something: a web page could post them cross-site without a
    preflight (the ones that pause, release or start something need JSON)."""
    setattr(endpoint, BODYLESS_MARK, True)
    return endpoint


class RouteMarks:
    """Which request paths reach a route marked `admin_endpoint` or `bodyless_endpoint`, from an app's routes
    (fixed paths in a set, templated ones such as ``/v1/responses/{response_id}/cancel`` by their pattern).

    Args:
        routes: the app's routes (`FastAPI.routes`, once every router is included).
    """

    def __init__(self, routes):
        self._admin = _marked_paths(routes, ADMIN_MARK)
        self._bodyless = _marked_paths(routes, BODYLESS_MARK)

    def is_admin(self, path: str) -> bool:
        """Whether `path` is an admin endpoint's."""
        return _matches_any(self._admin, path)

    def takes_no_body(self, path: str) -> bool:
        """Whether `path` is a POST endpoint that takes no body."""
        return _matches_any(self._bodyless, path)


def _marked_paths(routes, mark: str):
    fixed, patterns = set(), []
    for route in routes:
        if getattr(getattr(route, "endpoint", None), mark, False):
            if getattr(route, "param_convertors", None):
                patterns.append(route.path_regex)
            else:
                fixed.add(route.path)
    return frozenset(fixed), tuple(patterns)


def _matches_any(marked, path: str) -> bool:
    fixed, patterns = marked
    return path in fixed or any(p.match(path) for p in patterns)


async def send_error(scope: Scope, send: Send, message: str, status_code: int,
                     headers: Optional[list] = None) -> None:
    """Send a complete JSON error response (the shape of the path's API: error_bodies.error_body) from ASGI
    middleware."""
    body = orjson.dumps(error_body(scope.get("path", ""), message, status_code))
    await send({"type": "http.response.start", "status": status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def bearer_token(headers) -> Optional[str]:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    auth = headers.get("authorization")
    if not auth:
        return None
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def request_key(headers) -> Optional[str]:
    """The key a request carries: its ``Authorization: Bearer KEY``, else its ``x-api-key`` header (Anthropic's
    clients), else None."""
    token = bearer_token(headers)
    return token if token is not None else headers.get("x-api-key")


def _matches(token: Optional[str], key: Optional[str]) -> bool:
    return token is not None and key is not None and hmac.compare_digest(token.encode(), key.encode())


def is_json_content_type(value: Optional[str]) -> bool:
    """application/json or application/*+json (parameters such as charset allowed)."""
    if not value:
        return False
    msg = email.message.Message()
    msg["content-type"] = value
    if msg.get_content_maintype() != "application":
        return False
    sub = msg.get_content_subtype()
    return sub == "json" or sub.endswith("+json")


class KeyChecker:
    """Decides which key a request needs (see the module docstring).

    Args:
        api_key / admin_api_key: the server's keys (None: not set).
        marks: the app's marked routes (`RouteMarks`).
    """

    def __init__(self, api_key: Optional[str], admin_api_key: Optional[str], marks: RouteMarks):
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.marks = marks

    def allows(self, headers, path: str) -> bool:
        """Whether a request for `path` carries the key its endpoint needs."""
        if self.marks.is_admin(path):
            key = self.admin_api_key if self.admin_api_key is not None else self.api_key
        elif path.startswith(PUBLIC_PREFIXES):
            key = None
        else:
            key = self.api_key
        return key is None or _matches(request_key(headers), key)


class BodyTooLarge(HTTPException):
    """The request body passed --max-request-body-bytes while it was read (answered 413)."""

    def __init__(self, limit: int):
        super().__init__(413, f"The request body exceeds the limit of {limit} bytes (--max-request-body-bytes)")


def is_empty_body(headers) -> bool:
    """Whether a request declares no body (``Content-Length: 0``, or neither Content-Length nor
    Transfer-Encoding)."""
    length = headers.get("content-length")
    return length == "0" or (length is None and headers.get("transfer-encoding") is None)


class GuardMiddleware:
    """Pure ASGI middleware: 401 without an accepted key, 415 for a POST/PUT that is not JSON (but an empty POST
    to a route `keys.marks` says takes no body), 413 for a body over `max_body_bytes`."""

    def __init__(self, app: ASGIApp, keys: KeyChecker, max_body_bytes: int):
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        if not self.keys.allows(request.headers, scope["path"]):
            which = "admin api key" if self.keys.marks.is_admin(scope["path"]) else "api key"
            return await send_error(scope, send, f"Unauthorized: this endpoint requires 'Authorization: Bearer "
                                                 f"<{which}>'", 401, [(b"www-authenticate", b"Bearer")])
        if scope["method"] in ("POST", "PUT") and not is_json_content_type(request.headers.get("content-type")) \
                and not (self.keys.marks.takes_no_body(scope["path"]) and is_empty_body(request.headers)):
            return await send_error(scope, send, "Unsupported media type: send the body as JSON with "
                                                 "'Content-Type: application/json'", 415)
        limit = self.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await send_error(scope, send, BodyTooLarge(limit).detail, 413)
        received = 0

        async def receive_limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, receive_limited, send)


class HeadAsGet:
    """Pure ASGI middleware: HEAD wherever GET is served (RFC 9110 9.3.2: the GET's status and headers, no
    body), as uptime probes send it. The request runs as a GET and the body is dropped; where GET is not
    served, HEAD answers as GET would (405 / 404). FastAPI's routes do not add HEAD themselves."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)

        async def send_headers_only(message):
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, send_headers_only)
