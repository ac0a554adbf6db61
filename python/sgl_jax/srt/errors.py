"""Errors a request can end with, shared by the HTTP server, the Engine and the managers, and the error a server
that cannot start ends with."""

from typing import Optional


class RequestError(Exception):
    """A request the server refuses: `status_code` is the HTTP status (400 invalid, 413 too large, 503 down);
    `param` the request field at fault, when one is (OpenAI's error ``param``)."""

    def __init__(self, message: str, status_code: int = 400, retry_after_s: int = 0, param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.retry_after_s = retry_after_s  # > 0: the HTTP answer carries ``Retry-After`` (503 when overloaded)
        self.param = param


class StartupError(RuntimeError):
    """The scheduler could not start. For a configuration error (a ValueError while it builds: an unsupported
    architecture, flags the model cannot take) the message is one line that says why; for anything else it carries
    the scheduler's traceback. ``python -m sgl_jax.launch_server`` prints it and exits 1."""
