"""Grammar compile containment: killable worker compiles, lanes, up-front limits, refusals of
grammars that accept no output, and timeout errors that name the real limit (issue 17)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import xgrammar as xgr

from structspec.config import GrammarConfig
from structspec.constraint_parse import API_STYLE, ConstraintFieldError, regex_constraint
from structspec.constraints import (
    ChoiceConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from structspec.grammar import GrammarBackend, GrammarError
from structspec.grammar.compile_pool import GENERAL, SMALL, CompilePool
from structspec.grammar.limits import find_limit_problem
from structspec.grammar.satisfiable import find_unsatisfiable
from structspec.regex_check import find_regex_problem
from tests.polling import wait_for

from .conftest import load_maskbench


def runaway_schema(tag: str, n: int = 10_000) -> JsonSchemaConstraint:
    """The attack's schema: ``n`` integer properties (minutes of compile, GBs of memory)."""
    return JsonSchemaConstraint({"type": "object", "properties": {
        f"{tag}{i}": {"type": "integer"} for i in range(n)}}, strict=False)


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (Linux /proc), in seconds."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def short_limit(backend: GrammarBackend) -> Iterator[GrammarBackend]:
    """The session backend with a 1.5 s compile limit and the property limit lifted, so the
    runaway schema reaches a worker; restored afterwards."""
    backend.compile(ChoiceConstraint(("warm",)))  # the compile processes are up
    saved = backend.config
    backend.config = dataclasses.replace(saved, compile_timeout_s=1.5,
                                         max_schema_properties=20_000)
    try:
        yield backend
    finally:
        backend.config = saved


def test_runaway_compile_is_killed_and_cheap_ones_go_on(short_limit: GrammarBackend) -> None:
    b = short_limit
    pool = b.pool
    general = pool.status()[GENERAL].size
    wait_for("an idle pool", lambda: all(st.settled for st in pool.status().values()), 10)
    before = set(b.worker_pids())
    t0 = time.perf_counter()
    runaways = [b.submit(runaway_schema(f"k{i}_")) for i in range(general + 1)]
    # the cheap request goes in while every general worker runs a runaway (one more waits)
    wait_for("the runaways on every general worker",
             lambda: pool.status()[GENERAL].busy == general, 1.0)
    t1 = time.perf_counter()
    cheap = b.compile(ChoiceConstraint(("alpha", "beta")), timeout=10)
    cheap_s = time.perf_counter() - t1
    assert isinstance(cheap, xgr.CompiledGrammar) and cheap_s < 2.0, cheap_s
    for fut in runaways:
        with pytest.raises(GrammarError) as info:
            fut.result()
        e = info.value
        assert e.code == "grammar_too_complex" and e.param == "json_schema"
        assert "within the 1.5 s limit" in e.message, e.message
    assert time.perf_counter() - t0 < 1.5 + 1.0
    # A request's future fails at its own deadline, maybe a moment before the pool kills its
    # worker, and the pool kills and replaces the workers one at a time: wait for the state
    # itself (every lane full and idle), not for "the pids changed", which is already true
    # while a runaway still runs beside a first replacement.
    wait_for("every killed worker replaced and the pool idle",
             lambda: all(st.settled for st in pool.status().values()), 5.0)
    after = b.worker_pids()
    assert set(after) != before and len(after) == len(before)
    # none of them keeps computing: CPU over a measured window (a window, not a wait)
    start = {pid: cpu_seconds(pid) for pid in after}
    time.sleep(0.5)
    busy = {pid: cpu_seconds(pid) - s for pid, s in start.items()}
    assert all(s < 0.1 for s in busy.values()), busy
    seconds, timeouts = b.drain_compile_stats()
    assert timeouts >= general + 1 and seconds


def test_expired_request_names_the_real_limit(short_limit: GrammarBackend) -> None:
    """The scheduler reads an expired compile with ``result(timeout=0)``: the message must
    give the configured limit, not the 0 s of that poll."""
    fut = short_limit.submit(runaway_schema("e"))
    deadline = time.perf_counter() + 10
    while not (fut.done() or fut.expired(time.perf_counter())):
        assert time.perf_counter() < deadline
        time.sleep(0.05)
    with pytest.raises(GrammarError, match=r"within the 1\.5 s limit") as info:
        fut.result(timeout=0)
    assert info.value.code == "grammar_too_complex"


def test_small_lane_job_past_its_slice_moves_on(hf_tokenizer: Any) -> None:
    """A small grammar that compiles slowly leaves the small lane after its slice (and still
    compiles in the general lane); a cheap grammar behind it is not held up."""
    b = GrammarBackend(hf_tokenizer, vocab_size=len(hf_tokenizer), stop_token_ids=[2],
                       config=GrammarConfig(num_compile_threads=1, small_lane_slice_s=0.2,
                                            small_grammar_bytes=1 << 20))
    try:
        b.compile(ChoiceConstraint(("warm",)), timeout=120)
        slow = b.submit(runaway_schema("s", n=300))  # ~0.3-1 s: "small" by the raised bound

        def moved_on() -> bool:
            """The slow job has left the small lane, whose worker is replaced and idle (or
            the job finished within its slice, on a fast machine)."""
            st = b.pool.status()
            left = slow.done() or st[GENERAL].busy + st[GENERAL].queued == 1
            return left and st[SMALL].settled

        wait_for("the slow job to leave the small lane", moved_on, 10.0)
        t = time.perf_counter()
        b.compile(ChoiceConstraint(("x", "y")), timeout=10)
        assert time.perf_counter() - t < 1.0
        assert isinstance(slow.result(timeout=60), xgr.CompiledGrammar)
    finally:
        b.shutdown()


class SlowStartPool(CompilePool):
    """A compile pool whose zygote starts ``SLOW_START_S`` late (a loaded machine)."""

    SLOW_START_S = 2.5

    def _zygote_command(self, fd: int) -> list[str]:
        return [sys.executable, "-c",
                f"import sys, time; time.sleep({self.SLOW_START_S}); "
                "from structspec.grammar.compile_worker import main; main(sys.argv[1:])",
                str(fd)]


def test_budget_of_a_job_queued_during_a_slow_start_counts_from_ready(hf_tokenizer: Any) -> None:
    """A job submitted before the compile processes are ready, with a limit shorter than their
    start, still compiles: its budget counts from ``ready_at``. (The dispatcher once expired
    such jobs at their first deadline, before it moved them: CI saw valid regex requests
    refused as ``grammar_too_complex``.)"""
    info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=len(hf_tokenizer),
                                              stop_token_ids=[2])
    pool = SlowStartPool(info.serialize_json(), vocab_size=len(hf_tokenizer),
                         stop_token_ids=[2], any_whitespace=False, general_workers=1,
                         small_workers=1, small_slice_s=2.0)
    try:
        limit_s = 0.5
        submitted = time.perf_counter()
        jobs = [pool.submit(RegexConstraint(r"(yes|no), [0-9]{1,2}"), small=True,
                            deadline=submitted + limit_s, limit_s=limit_s),
                pool.submit(ChoiceConstraint(("a", "b")), small=False,
                            deadline=submitted + limit_s, limit_s=limit_s)]
        time.sleep(limit_s)
        assert pool.ready_at is None  # past its first deadline, still starting: joinable
        assert pool.extend(jobs[0], time.perf_counter() + limit_s)
        for job in jobs:
            assert isinstance(job.future.result(timeout=60), float)  # compile seconds
        assert pool.ready_at is not None
        assert pool.ready_at - submitted >= SlowStartPool.SLOW_START_S - 0.1
        assert not pool.extend(jobs[0], time.perf_counter() + 60)  # done: not joinable
        late = pool.submit(ChoiceConstraint(("c",)), small=True,
                           deadline=time.perf_counter() - 1, limit_s=limit_s)
        assert not pool.extend(late, time.perf_counter() + 60)  # past its deadline
        with pytest.raises(GrammarError, match="within the 0.5 s limit"):
            late.future.result(timeout=30)
    finally:
        pool.close()


# ---------------------------------------------------------------------------------- limits


@pytest.mark.parametrize("spec, fragment", [
    (runaway_schema("p"), "'properties' has 10000 entries, over the limit of 2048"),
    (JsonSchemaConstraint({"enum": list(range(100_001))}),
     "'enum' has 100001 values, over the limit of 100000"),
    (RegexConstraint("a{0,70000}"), "repeats 70000 times"),
    (JsonSchemaConstraint({"type": "string", "pattern": "[a-z]{99999}"}),
     "/pattern repeats 99999 times"),
    (ChoiceConstraint(("x" * (5 << 20),)), "over the limit of 4194304 bytes"),
])
def test_limits_refuse_up_front(backend: GrammarBackend, spec: Any, fragment: str) -> None:
    t = time.perf_counter()
    fut = backend.submit(spec)
    assert fut.done() and time.perf_counter() - t < 1.0  # no compile was started
    with pytest.raises(GrammarError) as info:
        fut.result()
    assert info.value.code == "grammar_too_complex" and fragment in info.value.message
    assert info.value.param == spec.kind  # the kind's --batch key (PARAM_BY_KIND)


def test_limits_pass_every_maskbench_schema_and_big_legitimate_grammars() -> None:
    config = GrammarConfig()
    for name, case in load_maskbench():
        spec = JsonSchemaConstraint(case["schema"], strict=False)
        assert find_limit_problem(spec, spec.canonical_text(), config) is None, name
    enum = JsonSchemaConstraint({"enum": [f"value-{i}" for i in range(100_000)]})
    assert find_limit_problem(enum, enum.canonical_text(), config) is None
    choice = ChoiceConstraint(tuple(f"option number {i:07d}" for i in range(45_000)))
    assert len(choice.canonical_text()) > 1_000_000
    assert find_limit_problem(choice, choice.canonical_text(), config) is None


@pytest.mark.slow
def test_100k_enum_compiles_alone(backend: GrammarBackend) -> None:
    """A 100k-value enum (~15 s of compile on 2 busy cores) still compiles alone under the
    default 30 s limit (the rebuild in the engine process that follows is not under it)."""
    saved = backend.config
    backend.config = dataclasses.replace(saved, compile_timeout_s=30.0)
    try:
        spec = JsonSchemaConstraint({"enum": [f"v{i}" for i in range(100_000)]})
        compiled = backend.compile(spec)
        m = backend.create_matcher(compiled)
        assert m.xgr_matcher.accept_string('"v99999"')
    finally:
        backend.config = saved


# ------------------------------------------------------------------ schemas with no output


@pytest.mark.parametrize("schema, fragment", [
    (False, "/: the schema is false"),
    ({"not": {}}, "/: the schema accepts no value (false, or 'not' of a schema that accepts"),
    ({"type": "string", "not": {}}, "/: 'not' of a schema that accepts everything"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
     "/properties/a: a required value refers back to / with no finite way out"),
    ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "refers back to /"),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "/items: a required value"),
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]},
     "/properties/a: an empty 'enum'"),
])
def test_schemas_with_no_output_are_refused(backend: GrammarBackend, schema: Any,
                                            fragment: str) -> None:
    assert find_unsatisfiable(schema) is not None
    for strict in (False, True):
        with pytest.raises(GrammarError) as info:
            backend.compile(JsonSchemaConstraint(schema, strict=strict))
        assert info.value.param == "json_schema"
        assert "accepts no finite JSON value" in info.value.message
        assert fragment in info.value.message, info.value.message


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
    {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
     "required": ["a"]},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
     "additionalProperties": False},  # xgrammar drops 'b': the grammar still ends
])
def test_satisfiable_recursion_is_kept(schema: Any) -> None:
    assert find_unsatisfiable(schema) is None


def test_no_maskbench_schema_is_refused_as_unsatisfiable() -> None:
    refused = [(name, find_unsatisfiable(case["schema"])) for name, case in load_maskbench()]
    assert [r for r in refused if r[1] is not None] == []


# ---------------------------------------------------------------------------------- regex


@pytest.mark.parametrize("pattern, fragment", [
    (r"\q", r"unknown escape '\q' at position 0"),
    ("a[^]b", "empty character class '[^]' at position 1"),
    ("[]", "empty character class '[]'"),
    ("x\\", "trailing backslash"),
])
def test_misread_regex_is_refused_naming_the_field(backend: GrammarBackend, pattern: str,
                                                   fragment: str) -> None:
    assert fragment in (find_regex_problem(pattern) or "")
    with pytest.raises(ConstraintFieldError) as parsed:
        regex_constraint(pattern, "response_format.regex", API_STYLE)
    assert parsed.value.field == "response_format.regex" and fragment in str(parsed.value)
    with pytest.raises(GrammarError) as compiled:  # a RegexConstraint built by hand
        backend.compile(RegexConstraint(pattern))
    assert compiled.value.param == "regex" and fragment in compiled.value.message


@pytest.mark.parametrize("pattern", [
    r"\d{3}-\w+\s*", r"[\]a-z]+", r"\.\/\-\(\)", r"\x41\u0042", r"[^\]]+", r"(a|b)\1?",
    r"\p{L}+", r"[a\-z]",
])
def test_ordinary_regex_syntax_passes(pattern: str) -> None:
    assert find_regex_problem(pattern) is None, pattern
