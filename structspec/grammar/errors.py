"""Errors raised by the grammar layer.

A :class:`GrammarError` always belongs to one request: the scheduler ends that request with
``error=str(exc)`` and ``error_param=exc.param`` (an HTTP 400 in the server) and every other
request goes on.
"""

from __future__ import annotations

from structspec.constraints import PARAM_BY_KIND

__all__ = ["GRAMMAR_TOO_COMPLEX", "PARAM_BY_KIND", "GrammarError"]

GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
"""The error ``code`` of a grammar refused for its cost: over an up-front limit
(:mod:`structspec.grammar.limits`) or still compiling at ``GrammarConfig.compile_timeout_s``."""


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled or enforced.

    Args:
        message: what went wrong, for the user (compile failures carry the compiler's message,
            e.g. ``"Failed to compile json_schema grammar: ..."``).
        param: the field at fault, by grammar kind (``"json_schema"``, ``"regex"``; see
            :data:`~structspec.constraints.PARAM_BY_KIND`); the server names the request
            field the grammar came from instead.
        code: a machine-readable code for the HTTP error (:data:`GRAMMAR_TOO_COMPLEX`), or
            None (the server then uses its generic ``invalid_request_parameter``).
    """

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[object, ...]:  # picklable across processes (keyword args)
        return (_rebuild, (self.message, self.param, self.code))


def _rebuild(message: str, param: str | None, code: str | None = None) -> GrammarError:
    return GrammarError(message, param=param, code=code)
