"""The xgrammar backend: asynchronous, cached grammar compilation and matcher creation.

One :class:`GrammarBackend` per served model (it holds the tokenizer's vocabulary). The
scheduler calls :meth:`GrammarBackend.submit` when a request arrives (never blocks), polls
:meth:`GrammarFuture.done` / :meth:`GrammarFuture.expired` each loop iteration, then turns the
result into a per-request :class:`~.matcher.Matcher` with :meth:`GrammarBackend.create_matcher`.

Source of the design: sglang's xgrammar backend and grammar manager (compile on a thread pool
keyed by ``(kind, text)``, cache the compiled prototype and the failures, dedupe in-flight
compiles).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import xgrammar as xgr

from structspec.config import GrammarConfig
from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from structspec.grammar.bitmask import allocate_bitmask
from structspec.grammar.errors import PARAM_BY_KIND, GrammarError
from structspec.grammar.matcher import Matcher
from structspec.grammar.schema_check import find_unenforceable
from structspec.schema_structure import find_structure_problem

CacheKey = tuple[str, str]


class GrammarFuture:
    """A pending (or finished) compilation, as returned by :meth:`GrammarBackend.submit`.

    Args:
        future: the shared compile future (several requests may wait on the same one).
        timeout_s: the compile time limit (``GrammarConfig.compile_timeout_s``).
        submitted_at: ``time.perf_counter()`` at submission.
    """

    def __init__(self, future: Future[xgr.CompiledGrammar], *, timeout_s: float,
                 submitted_at: float, kind: str) -> None:
        self._future = future
        self.timeout_s = timeout_s
        self.submitted_at = submitted_at
        self.kind = kind

    def done(self) -> bool:
        """Whether the compilation finished (successfully or not)."""
        return self._future.done()

    def expired(self, now: float) -> bool:
        """Whether it is still running ``timeout_s`` after submission (``now``: perf_counter)."""
        return not self._future.done() and now - self.submitted_at > self.timeout_s

    def result(self, timeout: float | None = None) -> xgr.CompiledGrammar:
        """The compiled grammar, waiting at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait; ``None`` = until ``timeout_s`` after submission.

        Raises:
            GrammarError: the compile failed (the compiler's message), the spec is invalid or
                not enforceable, or the wait exceeded the limit
                ("grammar compilation exceeded {t}s").
        """
        limit = self.timeout_s if timeout is None else timeout
        wait = max(0.0, self.submitted_at + self.timeout_s - time.perf_counter()) \
            if timeout is None else timeout
        try:
            return self._future.result(timeout=wait)
        except FutureTimeout:
            raise GrammarError(f"grammar compilation exceeded {limit:g}s",
                               param=PARAM_BY_KIND.get(self.kind)) from None


class GrammarBackend:
    """Compiles grammar specs for one tokenizer and creates per-request matchers.

    Args:
        tokenizer_hf: a Hugging Face tokenizer (``PreTrainedTokenizerFast``).
        vocab_size: the model's logits width (may exceed ``len(tokenizer_hf)``; the extra ids
            are never allowed by any grammar). Bitmasks have ``ceil(vocab_size / 32)`` words.
        stop_token_ids: ids that end an output (pass them explicitly: e.g. SmolLM2's GGUF
            conversion reports the wrong EOS).
        config: compile threads, cache bound, timeout, whitespace and rollback settings.

    Compile options: JSON Schema with ``strict_mode=True`` and ``any_whitespace`` from the
    config (``False``: xgrammar's default separators ``", "`` and ``": "``).
    """

    def __init__(
        self,
        tokenizer_hf: Any,
        *,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        config: GrammarConfig | None = None,
    ) -> None:
        self.config = config or GrammarConfig()
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer_hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        # Our own LRU cache below replaces xgrammar's (unbounded) one.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=self.config.num_compile_threads, cache_enabled=False)
        self._executor = ThreadPoolExecutor(
            max_workers=self.config.num_compile_threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[CacheKey, Future[xgr.CompiledGrammar]] = OrderedDict()

    # -- compilation ----------------------------------------------------------------------

    def submit(self, spec: GrammarConstraint) -> GrammarFuture:
        """Start compiling ``spec`` (or reuse a cached / in-flight compile); never blocks.

        Errors (invalid spec, compile failure, unenforceable schema) surface from
        :meth:`GrammarFuture.result` as :class:`GrammarError`; failures are cached too.
        """
        now = time.perf_counter()
        kind = spec.kind
        try:
            key = self._key(spec)
        except (ValueError, TypeError) as e:
            failed: Future[xgr.CompiledGrammar] = Future()
            failed.set_exception(GrammarError(str(e), param=PARAM_BY_KIND.get(kind)))
            return GrammarFuture(failed, timeout_s=self.config.compile_timeout_s,
                                 submitted_at=now, kind=kind)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
            else:
                fut = self._executor.submit(self._compile_now, spec)
                self._cache[key] = fut
                self._evict()
        return GrammarFuture(fut, timeout_s=self.config.compile_timeout_s, submitted_at=now,
                             kind=kind)

    def compile(self, spec: GrammarConstraint, timeout: float | None = None) -> xgr.CompiledGrammar:
        """Blocking convenience: ``submit(spec).result(timeout)``.

        Raises:
            GrammarError: see :meth:`GrammarFuture.result`.
        """
        return self.submit(spec).result(timeout)

    def create_matcher(self, compiled: xgr.CompiledGrammar) -> Matcher:
        """A fresh per-request matcher over a compiled grammar (cheap)."""
        return Matcher(compiled, stop_token_ids=self.stop_token_ids,
                       max_rollback_tokens=self.config.max_rollback_tokens)

    def cache_size(self) -> int:
        """Number of cache entries (finished and in flight)."""
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        """Stop accepting compiles; running ones finish in the background."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals ----------------------------------------------------------------------

    @staticmethod
    def _key(spec: GrammarConstraint) -> CacheKey:
        if isinstance(spec, JsonSchemaConstraint):
            # The strict check may fail where the non-strict compile succeeds: separate keys.
            return ("json_schema:strict" if spec.strict else "json_schema"), schema_text(spec)
        return spec.kind, spec.canonical_text()

    def _evict(self) -> None:
        # Called with the lock held. In-flight entries are kept (they dedupe waiters).
        excess = len(self._cache) - self.config.cache_max_entries
        if excess <= 0:
            return
        for key in [k for k, f in self._cache.items() if f.done()][:excess]:
            del self._cache[key]

    def _compile_now(self, spec: GrammarConstraint) -> xgr.CompiledGrammar:
        """Runs on a compile thread; every failure becomes a :class:`GrammarError`."""
        kind = spec.kind
        param = PARAM_BY_KIND.get(kind)
        try:
            if isinstance(spec, JsonSchemaConstraint):
                text = schema_text(spec)
                schema = json.loads(text)
                problem = find_structure_problem(schema)
                if problem is not None:
                    raise GrammarError(f"json_schema cannot be served: {problem}", param=param)
                if spec.strict:
                    self._check_enforceable(schema, param)
                return self._accepts_output(self._compiler.compile_json_schema(
                    text, any_whitespace=self.config.any_whitespace, strict_mode=True), param)
            if isinstance(spec, JsonObjectConstraint):
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=self.config.any_whitespace,
                    strict_mode=True)
            if isinstance(spec, RegexConstraint):
                return self._accepts_output(self._compiler.compile_regex(spec.pattern), param)
            if isinstance(spec, EbnfConstraint):
                return self._accepts_output(
                    self._compiler.compile_grammar(spec.grammar, root_rule_name="root"), param)
            if isinstance(spec, ChoiceConstraint):
                return self._compiler.compile_grammar(choice_ebnf(spec.choices))
            raise GrammarError(f"unknown grammar kind {kind!r}", param=param)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/...
            message = _compiler_message(e)
            if isinstance(spec, JsonSchemaConstraint):
                # xgrammar names neither the place nor the rule ("Unsupported type
                # "objectz"", or an internal check's text): say where the schema breaks its
                # metaschema, when it does, and keep the compiler's words after it.
                problem = metaschema_problem(spec)
                if problem is not None:
                    message = f"{problem} (compiler: {message})"
            raise GrammarError(f"Failed to compile {kind} grammar: {message}",
                               param=param) from e

    def _accepts_output(self, compiled: xgr.CompiledGrammar,
                        param: str | None) -> xgr.CompiledGrammar:
        """``compiled``, unless its start state allows no token at all (not even a stop
        token): a grammar whose language is empty, e.g. a schema whose ``$ref`` cycle has no
        base case. Such a request would otherwise fail at its first token with a
        "grammar rejected token" error that looks like an engine fault.

        Raises:
            GrammarError: the grammar accepts no output.
        """
        bitmask = allocate_bitmask(1, self.vocab_size, pin=False)
        self.create_matcher(compiled).fill_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise GrammarError("the grammar accepts no output at all (for a JSON Schema: a "
                               "$ref cycle with no way out, or contradictory constraints)",
                               param=param)
        return compiled

    @staticmethod
    def _check_enforceable(schema: Any, param: str | None) -> None:
        if not isinstance(schema, dict):
            return
        problems = find_unenforceable(schema)
        if problems:
            shown = "; ".join(f"{p or '/'}: {r}" for p, r in problems[:5])
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise GrammarError(
                "json_schema cannot be enforced exactly in strict mode: " + shown + more
                + ". Remove these keywords or set strict to false (best effort).", param=param)


def schema_text(spec: JsonSchemaConstraint) -> str:
    """The schema as compact JSON text, key order kept (the compile input and cache key):
    :meth:`JsonSchemaConstraint.canonical_text`, which raises ``ValueError`` for text that is not
    JSON or a schema that is not an object/boolean."""
    return spec.canonical_text()


def metaschema_problem(spec: JsonSchemaConstraint) -> str | None:
    """Where ``spec``'s schema breaks its metaschema (the draft its ``$schema`` names, else
    2020-12), as ``"invalid JSON Schema at <JSON pointer>: <reason>"``; None when it does not,
    or when the ``jsonschema`` package is missing or cannot check it.

    Used only to explain a compile failure: schemas that xgrammar compiles are never refused
    for a metaschema violation (it may accept older drafts' forms).
    """
    try:
        import jsonschema
        from jsonschema.exceptions import best_match

        schema = json.loads(schema_text(spec))
        cls = jsonschema.validators.validator_for(schema,
                                                  default=jsonschema.Draft202012Validator)
        error = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    except Exception:  # noqa: BLE001 - an explanation only; the compile error stands alone
        return None
    if error is None:
        return None
    pointer = "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in error.path)
    return f"invalid JSON Schema at {pointer or '/'}: {error.message}"


def choice_ebnf(choices: Sequence[str]) -> str:
    """A GBNF grammar whose sentences are exactly ``choices`` (``root ::= "a" | "b"``).

    Raises:
        GrammarError: when ``choices`` is empty or contains an empty string.
    """
    if not choices or any(not isinstance(c, str) or not c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings",
                           param="choice")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _compiler_message(e: BaseException) -> str:
    """The useful part of an xgrammar exception (drop the ``[time] file.cc:line:`` prefix)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[-1] if lines else type(e).__name__
    if msg.startswith("[") and ": " in msg:
        head, _, rest = msg.partition(": ")
        if ".cc:" in head or ".h:" in head:
            msg = rest
    return msg
