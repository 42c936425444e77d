"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from structspec.core import request_error_code


class APIError(Exception):
    """An error the HTTP layer turns into an OpenAI error response.

    Args:
        status: HTTP status code.
        message: what went wrong, for the user.
        type: OpenAI error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault, if any.
        code: a machine-readable code (e.g. ``context_length_exceeded``; vLLM's 404 uses the
            number ``404``), if any.
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the response (also the payload of an SSE error event)."""
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI sends it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``; without its own ``code``, the one the Python API gives
    the same refusal (:func:`structspec.core.request_error_code`: ``invalid_request_parameter``
    for a named field other than ``prompt``), whether the front end or the engine refused."""
    return APIError(400, message, param=param, code=request_error_code(param, code))


def model_not_found(name: str) -> APIError:
    """A 404 for a ``model`` the server does not serve, exactly as vLLM sends it."""
    return APIError(404, f"The model `{name}` does not exist.", type="NotFoundError",
                    param="model", code=404)


def unavailable(message: str) -> APIError:
    """A 503 (engine not ready, shutting down, or gone)."""
    return APIError(503, message, type="service_unavailable", code="engine_unavailable")


def server_error(message: str) -> APIError:
    """A 500 (an engine bug, reported with its message)."""
    return APIError(500, message, type="server_error", code="internal_error")
