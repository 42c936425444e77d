"""Errors raised by the grammar layer.

A :class:`GrammarError` always belongs to one request: the scheduler ends that request with
``error=str(exc)`` and ``error_param=exc.param`` (an HTTP 400 in the server) and every other
request goes on.
"""

from __future__ import annotations

from structspec.constraints import PARAM_BY_KIND

__all__ = ["PARAM_BY_KIND", "GrammarError"]


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled or enforced.

    Args:
        message: what went wrong, for the user (compile failures carry the compiler's message,
            e.g. ``"Failed to compile json_schema grammar: ..."``).
        param: the request field at fault, e.g. ``"response_format.json_schema"``.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:  # picklable across processes (keyword arg)
        return (_rebuild, (self.message, self.param))


def _rebuild(message: str, param: str | None) -> GrammarError:
    return GrammarError(message, param=param)
