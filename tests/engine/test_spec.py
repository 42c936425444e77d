"""Speculative decoding end to end: lossless at temperature 0, exactly-once grammar advance,
clean finishes inside multi-token runs, metrics."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator

import pytest

from structspec import (
    LLM,
    EbnfConstraint,
    FinishReason,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from structspec.models.shipped_heads import DEFAULT_MODEL_EAGLE_HEAD
from tests.engine.conftest import KV_CAPACITY_TOKENS, PERSON_SCHEMA, PROMPTS, release_memory
from tests.scheduler.test_tree_sizing import FixedCost

GBNF = 'root ::= "Answer: " ("yes" | "no") " because " [a-z ]+ "."'


def mixed_params(n: int) -> list[SamplingParams]:
    """A mix of unconstrained and grammar-constrained requests (JSON Schema, regex, EBNF)."""
    out = []
    for i in range(n):
        grammar = [None, JsonSchemaConstraint(PERSON_SCHEMA), RegexConstraint(r"[A-Z][a-z]+( [a-z]+){2,6}\."),
                   EbnfConstraint(GBNF)][i % 4]
        out.append(SamplingParams(max_tokens=32, grammar=grammar))
    return out


LOSSLESS_PROMPTS = PROMPTS[:20]  # the long variant (slow)

# Engine options per drafter. The order is the order the lossless tests build them in: the
# two used most by the later tests (first layers, n-gram) come last, so they are still in the
# session's engine cache (tests/engine/conftest.py, three engines) when those tests ask for them.
SPEC_CONFIGS = {
    "draft_model_self": lambda d: dict(speculative_algorithm="draft_model",
                                       draft_model=d["self"], num_draft_tokens=5,
                                       speculative_depth=4, speculative_topk=1),
    # the head shipped for the default model (trained on its features: it drafts tokens that
    # get accepted, so accepted paths, rejections and the bonus token are all exercised)
    "eagle_shipped_head": lambda d: dict(speculative_algorithm="eagle",
                                         draft_model=str(DEFAULT_MODEL_EAGLE_HEAD),
                                         num_draft_tokens=6, speculative_depth=3,
                                         speculative_topk=2),
    "draft_model_first_layers": lambda d: dict(speculative_algorithm="draft_model",
                                               draft_model=d["first_layers"], num_draft_tokens=6,
                                               speculative_depth=3, speculative_topk=2),
    "ngram": lambda d: dict(speculative_algorithm="ngram", num_draft_tokens=8),
}


@pytest.fixture(scope="session")
def draft_paths(smol_dir, smol_first_layers_dir, tmp_path_factory) -> dict[str, str]:
    from pathlib import Path

    from structspec.config import ModelConfig
    from structspec.models.eagle_head import build_random_eagle_head

    eagle_dir = tmp_path_factory.mktemp("eagle")
    target_cfg = ModelConfig.from_hf_config(json.loads((Path(smol_dir) / "config.json").read_text()))
    build_random_eagle_head(target_cfg, str(eagle_dir), seed=0)
    return {"first_layers": smol_first_layers_dir, "self": smol_dir, "eagle": str(eagle_dir)}


def cut_params() -> list[SamplingParams]:
    """The 8-request mix of the overlap, mask-worker and dead-worker tests: every grammar kind
    and unconstrained requests, with a stop string cutting a free run ([1]) and a JSON run
    ([2]), so stop strings and grammar ends both end runs."""
    params = mixed_params(8)
    params[1] = SamplingParams(max_tokens=32, stop=[" the"], grammar=None)
    params[2] = SamplingParams(max_tokens=32, stop=["a"], grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    return params


@pytest.fixture(scope="module")
def spec_off_outputs(make_llm) -> list:
    """PROMPTS[:8] under :func:`cut_params` without speculation (the lossless reference)."""
    return make_llm().generate(PROMPTS[:8], cut_params())


@pytest.fixture(scope="module")
def in_process_outputs(make_llm, draft_paths) -> Callable[[str], list]:
    """``get(algo)``: PROMPTS[:8] under :func:`cut_params` with the algorithm's default engine
    (overlap on, masks built in-process), generated once per module: what the lossless test
    compares with the output without speculation, and the reference that the overlap-off,
    mask-worker and dead-worker runs must equal."""
    done: dict[str, list] = {}

    def get(algo: str) -> list:
        if algo not in done:
            llm = make_llm(**SPEC_CONFIGS[algo](draft_paths))
            done[algo] = llm.generate(PROMPTS[:8], cut_params())
        return done[algo]

    return get


def check_lossless(name: str, want: list, got: list, params: list[SamplingParams]) -> None:
    """``got`` (speculation ``name``) equals ``want`` (none) token for token, with the same
    text and finish; the drafts were used."""
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids, (name, g.request_id)
        assert g.text == w.text and g.finish_reason == w.finish_reason
        assert g.stop_reason == w.stop_reason
    steps = sum(g.spec.verify_steps for g in got)
    tokens = sum(g.spec.committed_tokens for g in got)
    assert steps > 0 and tokens >= steps
    if name == "eagle_shipped_head":
        assert sum(g.spec.draft_tokens_accepted for g in got) > 0
    if name == "draft_model_self":
        # The target drafting for itself is always right on unconstrained requests (its
        # drafts ignore the grammar, so constrained ones diverge): every step keeps the whole
        # 4-token chain plus the bonus unless max_tokens or a stop string cut it.
        free = [g for g, p in zip(got, params, strict=True) if p.grammar is None]
        free_steps = sum(g.spec.verify_steps for g in free)
        assert sum(g.spec.committed_tokens for g in free) / free_steps > 3.5


# draft_model_self (the model as its own draft) runs under -m slow: draft_model_first_layers
# covers the draft-model path in the default suite (the suite's time budget, README)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n == "draft_model_self" else n for n in SPEC_CONFIGS])
def test_lossless_greedy(make_llm, draft_paths, spec_off_outputs, in_process_outputs,
                         name: str) -> None:
    """A mixed batch (no grammar, JSON Schema, regex, EBNF; stop strings cutting a free and a
    JSON run): greedy output with each drafter equals output without speculation; for a host
    and a device drafter also with adaptive tree sizing (:func:`check_adaptive_lossless`)."""
    check_lossless(name, spec_off_outputs, in_process_outputs(name), cut_params())
    if name in ("ngram", "eagle_shipped_head"):
        # the engine just used (a cache hit: the engine cache's order stays as it was)
        check_adaptive_lossless(name, make_llm(**SPEC_CONFIGS[name](draft_paths)),
                                spec_off_outputs)


def test_shipped_head_drafts_over_its_draft_vocabulary(make_llm, draft_paths) -> None:
    """The default head ships a draft vocabulary (structspec/speculative/draft_vocab.py): the
    drafter projects onto its 16,384 rows and maps ids through it, and drafts get accepted
    (the lossless tests above run with it)."""
    llm = make_llm(**SPEC_CONFIGS["eagle_shipped_head"](draft_paths))
    drafter = llm.engine.drafter
    assert drafter.reduced_lm_head is not None
    assert drafter.vocab_map is not None and drafter.vocab_map.numel() == 16384
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0.0))
    assert sum(o.spec.draft_tokens_accepted for o in out) > 0


def test_eagle_features_are_stored_before_the_wait(make_llm, draft_paths,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A verify step queues EAGLE's feature store (every tree row, ``num_rows=None``) before
    its one host wait, and commits the run lengths after it: the store's launches overlap the
    verify instead of leaving the device idle while the host commits."""
    from structspec.scheduler.pending import PendingStep

    llm = make_llm(**SPEC_CONFIGS["eagle_shipped_head"](draft_paths))
    guard = llm.engine.scheduler._verify.drafter
    events: list[str] = []
    original_wait, store, commit = PendingStep.wait, guard.on_target_hidden, \
        guard.commit_target_hidden

    def wait(step: PendingStep) -> list[list[int]]:
        events.append("wait")
        return original_wait(step)

    def on_target_hidden(reqs, hidden, rows, num_rows, aux=()) -> None:
        events.append("store" if num_rows is None else "store_counted")
        store(reqs, hidden, rows, num_rows, aux)

    def commit_target_hidden(reqs, num_rows) -> None:
        events.append("commit")
        commit(reqs, num_rows)

    monkeypatch.setattr(PendingStep, "wait", wait)
    monkeypatch.setattr(guard, "on_target_hidden", on_target_hidden)
    monkeypatch.setattr(guard, "commit_target_hidden", commit_target_hidden)
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.0))
    assert sum(o.spec.draft_tokens_accepted for o in out) > 0
    verify = [i for i, e in enumerate(events) if e == "store"]
    assert verify, events
    for i in verify:  # each verify step: store, its wait, then the commit of the counts
        assert events[i + 1 : i + 3] == ["wait", "commit"], events[i : i + 3]


def check_adaptive_lossless(name: str, llm: LLM, want: list) -> None:
    """Adaptive tree sizing (docs/architecture.md, invariant 2) only changes which drafts are
    proposed: with a CPU-like cost (fixed, so the sizes do not depend on this machine's
    timings) the batch verifies trees of several sizes in one step, plain-decode rows (trees
    of 1 node, under grammars too) and re-probes, and the output is the same."""
    sizer = llm.engine.scheduler.sizer
    saved = (sizer.mode, sizer.cost, sizer.probe_every)
    sizer.mode, sizer.cost, sizer.probe_every = "on", FixedCost(20.0, 8.0), 3
    params = cut_params()[:4]  # a free run, a stop string in a free and in a JSON run, EBNF
    try:
        got = llm.generate(PROMPTS[:4], params)
    finally:
        sizer.mode, sizer.cost, sizer.probe_every = saved
    check_lossless(name, want[:4], got, params)
    sizes = {n for g in got for n in g.spec.tree_sizes}
    assert 1 in sizes and len(sizes) > 1, sizes
    assert sum(g.spec.steps_without_draft for g in got) > 0
    assert sum(g.spec.draft_tokens_accepted for g in got) > 0


@pytest.fixture(scope="module")
def spec_off_outputs_20(make_llm) -> list:
    return make_llm().generate(LOSSLESS_PROMPTS, mixed_params(len(LOSSLESS_PROMPTS)))


@pytest.mark.slow  # the default suite runs the 8-request batch above
@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_lossless_greedy_20_requests(make_llm, draft_paths, spec_off_outputs_20,
                                     name: str) -> None:
    """As :func:`test_lossless_greedy` on a batch of 20 requests."""
    params = mixed_params(len(LOSSLESS_PROMPTS))
    got = make_llm(**SPEC_CONFIGS[name](draft_paths)).generate(LOSSLESS_PROMPTS, params)
    check_lossless(name, spec_off_outputs_20, got, params)


@pytest.mark.parametrize("algo", ["ngram", pytest.param("draft_model_first_layers",
                                                        marks=pytest.mark.slow)])
def test_overlap_on_and_off_give_identical_outputs(make_llm, draft_paths, in_process_outputs,
                                                    algo: str) -> None:
    """Host trees (ngram: mask before the deferred text work) and device trees (draft model:
    the deferred text work runs while the tree is still on its way) alike. The n-gram run
    builds an engine with ``overlap=False`` (the option's wiring); the draft-model run turns
    the cached engine's verify step to no overlap for its one generate (the same switch,
    without another engine's weights and draft model)."""
    on = in_process_outputs(algo)  # overlap on is the default
    if algo == "ngram":
        with LLM(device="cpu", dtype="float32", kv_capacity_tokens=KV_CAPACITY_TOKENS,
                 max_batch_size=32, overlap=False, **SPEC_CONFIGS[algo](draft_paths)) as llm:
            assert llm.engine.scheduler._verify.overlap is False  # noqa: SLF001
            off = llm.generate(PROMPTS[:8], cut_params())
        del llm
        release_memory()
    else:
        verify = make_llm(**SPEC_CONFIGS[algo](draft_paths)).engine.scheduler._verify  # noqa: SLF001
        verify.overlap = False
        try:
            off = make_llm(**SPEC_CONFIGS[algo](draft_paths)).generate(PROMPTS[:8], cut_params())
        finally:
            verify.overlap = True
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason


def test_exactly_once_advance_per_committed_token(make_llm) -> None:
    llm = make_llm(speculative_algorithm="ngram", num_draft_tokens=8)
    engine = llm.engine
    sched = engine.scheduler
    params = SamplingParams(max_tokens=60, grammar=JsonSchemaConstraint(PERSON_SCHEMA))
    prompt = ("Copy as JSON: {\"name\": \"Ann Lee\", \"age\": 41, \"city\": \"Oslo\"} and again "
              "{\"name\": \"Ann Lee\", \"age\": 41, \"city\": \"Oslo\"}")
    ids = [engine.add_request(prompt, params) for _ in range(3)]
    seen_multi = False
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for req in sched.running:
            if req.matcher is not None:
                # Ids committed in the last step (at most one tree's worth) wait for the grammar
                # barrier of the next one (it runs under the next verify forward); everything
                # older was advanced once.
                assert req.matcher.num_accepted == req.num_grammar_advanced, req.request_id
                lag = len(req.output_ids) - req.num_grammar_advanced
                assert 0 <= lag <= engine.drafter.num_nodes, (req.request_id, lag)
            seen_multi |= req.spec.committed_tokens > req.spec.verify_steps
    assert seen_multi
    for rid in ids:
        out = finished[rid]
        assert out.finish_reason is FinishReason.STOP
        assert json.loads(out.text)["name"]


def test_stops_inside_accepted_runs_match_spec_off(make_llm) -> None:
    base = make_llm()
    spec = make_llm(speculative_algorithm="ngram", num_draft_tokens=8)
    prompt = "Repeat exactly ten times: one two three four, one two three four, one two three four"
    free = base.generate(prompt, SamplingParams(max_tokens=48))[0]
    cases = [
        SamplingParams(max_tokens=48, stop=["three four, one"]),
        SamplingParams(max_tokens=17),
        SamplingParams(max_tokens=48, stop_token_ids=(free.token_ids[9],)),
        SamplingParams(max_tokens=48, stop=["three four, one"], include_stop_str_in_output=True),
    ]
    texts = []
    for sp in cases:
        w = base.generate(prompt, sp)[0]
        g = spec.generate(prompt, sp)[0]
        assert g.token_ids == w.token_ids and g.text == w.text, sp
        texts.append(g.text)
        assert g.finish_reason == w.finish_reason and g.stop_reason == w.stop_reason
        # Counts match the kept tokens: the first token comes from prefill, and nothing cut by
        # a stop is counted.
        assert g.spec.committed_tokens == len(g.token_ids) - 1
    assert texts[3] == texts[0] + "three four, one"  # the stop string kept, whatever drafts
    # The repetitive prompt makes n-gram drafts long, so the stops above landed mid-run.
    assert spec.generate(prompt, SamplingParams(max_tokens=48))[0].spec.accept_length > 1.5


def test_ngram_extraction_accept_length(make_llm) -> None:
    from benchmarks.workloads import EXTRACTION_SCHEMA, extraction_prompts

    llm = make_llm(speculative_algorithm="ngram", num_draft_tokens=8)
    prompts = [p for p, _ in extraction_prompts(6, seed=1)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=160,
                                                grammar=JsonSchemaConstraint(EXTRACTION_SCHEMA)))
    steps = sum(o.spec.verify_steps for o in outs)
    committed = sum(o.spec.committed_tokens for o in outs)
    assert committed / steps > 1.5, committed / steps
    assert all(o.schema_valid for o in outs if o.finish_reason is FinishReason.STOP)


@contextlib.contextmanager
def pool_llm(**kwargs: object) -> Iterator[LLM]:
    """A CPU engine with two mask worker processes. Not cached by make_llm: its weights, KV
    and workers go when the block ends."""
    options: dict[str, object] = dict(device="cpu", dtype="float32",
                                      kv_capacity_tokens=KV_CAPACITY_TOKENS, max_batch_size=32,
                                      grammar_workers=2)
    options.update(kwargs)
    llm = LLM(**options)  # type: ignore[arg-type]
    pool = llm.engine.scheduler.mask_pool
    assert pool is not None
    try:
        yield llm
    finally:
        llm.close()
        assert all(proc.poll() is not None for proc in pool._procs)  # workers stopped
        llm.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate("hi", SamplingParams(max_tokens=2))
        del llm
        release_memory()


@pytest.fixture(scope="module")
def ngram_pool_llm() -> Iterator[LLM]:
    """An n-gram engine with two mask worker processes (:func:`pool_llm`), shared by the
    mask-worker tests below in file order: starting the workers costs seconds of CPU each
    time. The dead-worker test, which replaces the pool, uses it last; the tests that need
    grammars still on their way to fresh workers build their own."""
    with pool_llm(**SPEC_CONFIGS["ngram"]({})) as llm:
        yield llm


def ngram_or_pool_llm(request: pytest.FixtureRequest, **kwargs: object
                      ) -> contextlib.AbstractContextManager[LLM]:
    """The shared n-gram pool engine (left open) for the n-gram options, else a
    :func:`pool_llm` of its own."""
    if kwargs == SPEC_CONFIGS["ngram"]({}):
        return contextlib.nullcontext(request.getfixturevalue("ngram_pool_llm"))
    return pool_llm(**kwargs)


# the draft model's own pool engine first: it is gone before the shared n-gram one starts
# both under -m slow (the suite's time budget): the default suite keeps the engine-level
# worker == in-process check of staggered arrivals below and the mask-level ones of
# tests/grammar/test_worker_pool.py
@pytest.mark.slow
@pytest.mark.parametrize("algo", ["draft_model_first_layers", "ngram"])
def test_mask_worker_processes_give_identical_outputs(request: pytest.FixtureRequest,
                                                      draft_paths, in_process_outputs,
                                                      algo: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Tree bitmasks built in two worker processes (mirror matchers) give the same outputs as
    the in-process build, with stop strings and grammar ends cutting runs. The mirrors are
    the grammar barrier, for host trees (ngram) and device trees (the draft model) alike:
    the engine process's matchers advance over almost none of the committed ids."""
    from structspec.grammar.matcher import Matcher

    params = cut_params()
    ref = in_process_outputs(algo)
    host_ids = [0]
    accept_run = Matcher.accept_run

    def counting_accept_run(self: Matcher, token_ids: list[int]) -> int:
        host_ids[0] += len(token_ids)
        return accept_run(self, token_ids)

    with ngram_or_pool_llm(request, **SPEC_CONFIGS[algo](draft_paths)) as llm:
        llm.engine.step_stats(reset=True)
        monkeypatch.setattr(Matcher, "accept_run", counting_accept_run)  # this process only
        got = llm.generate(PROMPTS[:8], params)
        assert llm.engine.scheduler.mask_pool.num_builds > 0
        # the steps the pool served carry its timings (averaged over those steps only)
        stats = llm.engine.step_stats()
        assert 1 <= stats["pool_workers"] <= 2
        assert stats["pool_send_ms"] > 0 and stats["pool_worker_max_ms"] > 0
        # the round trip's marks, in order: a worker starts, the last replies, all are read
        assert 0 <= stats["pool_first_start_ms"] <= stats["pool_last_reply_ms"]
        assert stats["pool_last_reply_ms"] <= stats["pool_read_ms"]
        # a CPU engine's workers sleep between steps (its torch threads take every core)
        assert llm.engine.scheduler.mask_pool.spin_ms == 0.0
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
    # the prefill's first token only
    assert host_ids[0] <= sum(p.grammar is not None for p in params), host_ids[0]


class _ArrivedCopy:
    """Stands in for a CUDA tree's pending D2H copy on the CPU: the mask build then takes the
    device-tree path, which CPU trees never reach otherwise. Its first ``done`` query says
    the copy is still on its way (work may run meanwhile); it has landed after that."""

    def __init__(self, log: list[str]) -> None:
        self._log = log
        self._queries = 0

    def done(self) -> bool:
        self._queries += 1
        return self._queries > 1

    def wait(self) -> None:
        self._log.append("resolve")


@pytest.mark.slow  # ~28 s each on 2 cores; the pooled build test below covers the mask workers
@pytest.mark.parametrize("order", ["after", "before"])
def test_device_tree_with_mirrors_matches_in_process_and_texts_after_the_verdicts(
        in_process_outputs, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """A device tree (the shipped EAGLE head's, its D2H copy simulated) with the mask workers'
    mirrors serving the barrier gives the in-process outputs, and each step's text work for
    the previous step runs only after its predicted verdicts are applied. Launched first
    (``order="after"``), the build applies the verdicts, starts the text work while the tree
    is on its way and resolves it after (then sends); sent before the verify launch
    (``order="before"``), the tree is resolved first, then the verdicts, then the launch."""
    from structspec.scheduler import deferred_work, verify_step
    from structspec.scheduler.build_order import PoolBuildOrder
    from structspec.scheduler.grammar_service import GrammarService

    log: list[str] = []
    stage_tree, apply_verdicts = GrammarService.stage_tree, GrammarService._apply_verdicts
    process_text, run = deferred_work.process_text, verify_step.VerifyStep.run

    def staged_as_device(self, reqs, tree):  # type: ignore[no-untyped-def]
        gtree = stage_tree(self, reqs, tree)
        if gtree is not None and tree.num_nodes > 1:
            gtree.copy = _ArrivedCopy(log)  # type: ignore[assignment]
        return gtree

    def logged(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            log.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(GrammarService, "stage_tree", staged_as_device)
    monkeypatch.setattr(GrammarService, "_apply_verdicts",
                        staticmethod(logged("verdicts", apply_verdicts)))
    monkeypatch.setattr(deferred_work, "process_text", logged("text", process_text))
    monkeypatch.setattr(verify_step.VerifyStep, "run", logged("step", run))
    monkeypatch.setattr(verify_step.VerifyStep, "_launch_verify",
                        logged("launch", verify_step.VerifyStep._launch_verify))
    ref = in_process_outputs("eagle_shipped_head")
    log.clear()
    with pool_llm(**SPEC_CONFIGS["eagle_shipped_head"]({})) as llm:
        llm.engine.scheduler._verify.build_order = PoolBuildOrder(order)  # type: ignore[arg-type]
        got = llm.generate(PROMPTS[:8], cut_params())
        assert llm.engine.scheduler.mask_pool.num_builds > 0
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
    steps = "|".join(log).split("step")
    mirrored = [s for s in steps if "resolve" in s and "verdicts" in s]
    assert mirrored, log
    texts_while_drafting = 0
    for s in mirrored:  # no text work before the step's verdicts are applied
        assert "text" not in s.split("verdicts")[0], s
        # each event's first time (a tree is resolved again by later readers)
        events = list(dict.fromkeys(e for e in s.split("|")
                                    if e in ("resolve", "verdicts", "launch")))
        want = (["resolve", "verdicts", "launch"] if order == "before"
                else ["launch", "verdicts", "resolve"])
        assert events == want, s
        texts_while_drafting += "text" in s.split("resolve")[0]
    # launched first, the text work starts while the tree is on its way
    assert (texts_while_drafting > 0) == (order == "after"), texts_while_drafting


def test_committed_id_the_grammar_forbids_is_never_reported(make_llm, ngram_pool_llm,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """With mirror matchers the scheduler applies the verdicts it predicts from the new ids
    and checks the mirrors' own verdicts when the walks arrive. A committed id that breaks
    the grammar (planted here; in the engine only a mask/matcher disagreement could commit
    one) contradicts the prediction: that request ends with a grammar error in the same step,
    the id is cut and its text dropped before anything is reported; the others run on."""
    _check_bad_id_is_never_reported(make_llm(**SPEC_CONFIGS["ngram"]({})),
                                    contextlib.nullcontext(ngram_pool_llm), monkeypatch)


@pytest.mark.slow  # ~20 s on 2 cores: a draft-model engine with workers of its own
def test_committed_id_the_grammar_forbids_is_never_reported_device_tree(
        make_llm, draft_paths, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a draft-model engine and workers, whose mirrors now serve the barrier
    for its trees too (the order of the text work against the verdicts is checked by
    :func:`test_device_tree_with_mirrors_matches_in_process_and_texts_after_the_verdicts`)."""
    config = SPEC_CONFIGS["draft_model_first_layers"](draft_paths)
    _check_bad_id_is_never_reported(make_llm(**config), pool_llm(**config), monkeypatch)


def _check_bad_id_is_never_reported(ref_llm: LLM,
                                    pooled: contextlib.AbstractContextManager[LLM],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from structspec.scheduler import verify_step as step_mod
    from structspec.scheduler.grammar_service import GrammarService

    params = [SamplingParams(max_tokens=40, grammar=JsonSchemaConstraint(PERSON_SCHEMA))
              for _ in range(4)]
    ref = ref_llm.generate(PROMPTS[:4], params)
    with pooled as llm:
        (newline,) = llm.engine.tokenizer.encode("\n")  # raw newlines break compact JSON
        commit = step_mod.commit_tokens
        planted: dict[str, int] = {}

        def commit_with_a_bad_id(req, run, t):  # type: ignore[no-untyped-def]
            if not planted and req.matcher is not None and len(req.output_ids) >= 4:
                planted[req.request_id] = len(req.output_ids) + 1
                run = run[:1] + [newline]  # the target's first token, then the bad id
            return commit(req, run, t)

        settle = GrammarService._settle_mismatches
        seen: list[dict[int, tuple[int, int, bool]]] = []

        def recording_settle(reqs, mismatched) -> None:  # type: ignore[no-untyped-def]
            if mismatched:
                seen.append(dict(mismatched))
            settle(reqs, mismatched)

        monkeypatch.setattr(step_mod, "commit_tokens", commit_with_a_bad_id)
        monkeypatch.setattr(GrammarService, "_settle_mismatches", staticmethod(recording_settle))
        got = llm.generate(PROMPTS[:4], params)
    (rid, kept), = planted.items()
    # the mirrors caught it (the in-process barrier would have ended the request too)
    assert len(seen) == 1 and [v[1:] for v in seen[0].values()] == [(1, False)], seen
    for a, b in zip(ref, got, strict=True):
        if b.request_id == rid:
            assert b.finish_reason == FinishReason.ABORT, b
            assert f"grammar rejected token {newline}" in (b.error or ""), b.error
            assert b.token_ids == a.token_ids[:kept] and newline not in b.token_ids
            assert "\n" not in b.text and a.text.startswith(b.text)
        else:
            assert b.error is None and b.schema_valid in (True, None), b


def test_pool_build_after_the_launch_and_switched_per_step_matches_in_process(
        ngram_pool_llm, in_process_outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool build sent right after the verify launch (the order the engine picks on a
    GPU while the walks hide under the forward; the CPU sends first), and the order switched
    from step to step as the measured times may switch it, give the in-process outputs: the
    mirrors get the same new ids, and the barrier and the walks run the same way, in either
    order."""
    from structspec.scheduler.build_order import PoolBuildOrder
    from structspec.scheduler.verify_step import VerifyStep

    class Alternating(PoolBuildOrder):
        """Launch first on the first step, then the other order each step."""

        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def send_first(self, *, device_tree: bool = False) -> bool:
            assert not device_tree  # an n-gram tree is on the host
            self.steps += 1
            return self.steps % 2 == 0

    ref = in_process_outputs("ngram")[:4]
    verify = ngram_pool_llm.engine.scheduler._verify
    assert verify.build_order.send_first()  # the CPU default
    pool = ngram_pool_llm.engine.scheduler.mask_pool
    builds = {"before": 0, "after": 0}  # pool builds per order

    def counted(method, order: str):  # type: ignore[no-untyped-def]
        def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            n = pool.num_builds
            try:
                return method(self, *args, **kwargs)
            finally:
                builds[order] += pool.num_builds - n
        return run

    monkeypatch.setattr(VerifyStep, "_launch_under_walks",
                        counted(VerifyStep._launch_under_walks, "before"))
    monkeypatch.setattr(VerifyStep, "_grammar_mask", counted(VerifyStep._grammar_mask, "after"))
    for order in (PoolBuildOrder("after"), Alternating()):
        monkeypatch.setattr(verify, "build_order", order)
        before = dict(builds)
        ngram_pool_llm.engine.step_stats(reset=True)
        got = ngram_pool_llm.generate(PROMPTS[:4], cut_params()[:4])
        assert builds["after"] > before["after"], order
        assert (builds["before"] > before["before"]) == isinstance(order, Alternating)
        # the step records say which order each pooled step took
        sent_first = ngram_pool_llm.engine.step_stats()["pool_sent_first"]
        pooled = builds["before"] - before["before"] + builds["after"] - before["after"]
        assert sent_first == pytest.approx((builds["before"] - before["before"]) / pooled)
        for a, b in zip(ref, got, strict=True):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert a.finish_reason == b.finish_reason


LIST_SCHEMA = {"type": "object", "properties": {"items": {"type": "array",
                                                          "items": {"type": "string"}}},
               "required": ["items"]}


STAGGER_A_PROMPT = ("Copy this list as JSON items: red, green, blue, red, green, blue, red, "
                    "green")
STAGGER_B_PROMPT = "Give me a JSON person: name Bob, age 40, city Paris."
STAGGER_A_MAX_TOKENS = (4, 3, 5, 6, 9)


def stagger_params(request: str, m: int) -> SamplingParams:
    """A: a list, ``max_tokens=m``; B: a person, ``max_tokens=40``."""
    if request == "A":
        return SamplingParams(max_tokens=m, grammar=JsonSchemaConstraint(LIST_SCHEMA))
    return SamplingParams(max_tokens=40, grammar=JsonSchemaConstraint(PERSON_SCHEMA))


def _staggered_outputs(engine) -> dict[str, tuple[list[int], object]]:  # type: ignore[no-untyped-def]
    """Constrained A (max_tokens m) runs; constrained B arrives once A has committed ids, so
    A may finish (leave the batch) while B, alone, keeps running; for several m."""
    sched = engine.scheduler
    outs = {}

    def step() -> None:
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = (list(o.token_ids), o.finish_reason)

    for m in STAGGER_A_MAX_TOKENS:
        engine.add_request(STAGGER_A_PROMPT, stagger_params("A", m), request_id=f"A{m}")
        while (a := sched.requests.get(f"A{m}")) is not None and not a.finished and len(
                a.output_ids) < 2:
            step()
        engine.add_request(STAGGER_B_PROMPT, stagger_params("B", m), request_id=f"B{m}")
        while engine.has_unfinished_requests():
            step()
    return outs


def _staggered_reference(llm: LLM) -> dict[str, tuple[list[int], object]]:
    """What :func:`_staggered_outputs` must give, from one batch of the same requests
    (masks built in-process): greedy fp32 output does not depend on which requests share
    the batch (test_generate.py, the lossless tests), and every B is the same request."""
    prompts = [STAGGER_A_PROMPT] * len(STAGGER_A_MAX_TOKENS) + [STAGGER_B_PROMPT]
    params = [stagger_params("A", m) for m in STAGGER_A_MAX_TOKENS] + [stagger_params("B", 0)]
    outs = llm.generate(prompts, params)
    ref = {f"A{m}": (list(o.token_ids), o.finish_reason)
           for m, o in zip(STAGGER_A_MAX_TOKENS, outs, strict=False)}
    ref.update({f"B{m}": (list(outs[-1].token_ids), outs[-1].finish_reason)
                for m in STAGGER_A_MAX_TOKENS})
    return ref


@pytest.mark.slow  # ~15 s on 2 cores: the suite's time budget (README, tests)
def test_mask_workers_with_staggered_arrivals_match_in_process(make_llm, ngram_pool_llm
                                                               ) -> None:
    """Requests that lag their mirrors leave the batch while another, alone below the worker
    count, keeps running: the step decides once whether the mirrors serve it, so no host
    matcher is walked while it lags (regression: the barrier and the build once decided
    differently, and B was aborted with "grammar rejected token")."""
    ref = _staggered_reference(make_llm(**SPEC_CONFIGS["ngram"]({})))
    pool = ngram_pool_llm.engine.scheduler.mask_pool
    builds = pool.num_builds
    ngram_pool_llm.engine.step_stats(reset=True)
    got = _staggered_outputs(ngram_pool_llm.engine)
    assert pool.num_builds > builds
    assert got == ref
    # the round trip's marks, in order: a worker starts, the last replies, all are read
    stats = ngram_pool_llm.engine.step_stats()
    assert 0 <= stats["pool_first_start_ms"] <= stats["pool_last_reply_ms"]
    assert stats["pool_last_reply_ms"] <= stats["pool_read_ms"]
    # a CPU engine's workers sleep between steps (its torch threads take every core)
    assert pool.spin_ms == 0.0


def test_deferred_builds_behind_an_emulated_device_wait_match_in_process(
        ngram_pool_llm, in_process_outputs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mask workers' device gate (structspec/grammar/deferred_build.py) with the device's
    wait emulated on the CPU: the upload "runs" once every busy worker's flag holds the
    build's number, the post-graph selection reads the caps from the segment, and the step
    reads the replies after it. The outputs equal the in-process run, and the drafts the
    grammar rejected are counted when the replies are read."""
    from structspec.grammar import tree_mask

    pool = ngram_pool_llm.engine.scheduler.mask_pool
    waited: list[int] = []

    def emulated_upload(host, device, waits, *, out=None):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 30
        for w, seq in waits:  # the "device address" is the worker's index here
            while int(pool.flags[w]) != seq:
                assert time.monotonic() < deadline, "a worker never stored its flag"
        waited.append(len(waits))
        return (host.clone() if out is None else out.copy_(host)), None

    monkeypatch.setattr(pool, "device_gate", True)
    monkeypatch.setattr(pool, "flag_device_pointers", lambda: list(range(pool.num_workers)))
    monkeypatch.setattr(tree_mask, "upload_pinned_gated", emulated_upload)
    ref = in_process_outputs("ngram")
    deferred = pool.num_deferred_builds
    got = ngram_pool_llm.generate(PROMPTS[:8], cut_params())
    assert pool.num_deferred_builds - deferred == len(waited) > 0 and max(waited) >= 1
    assert pool.deferred is None  # every deferred build's replies were read
    from structspec import staging

    assert not staging._BEFORE_HOST_SYNC  # and no completion is left registered
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason
    assert sum(o.spec.draft_tokens_rejected_by_grammar for o in got) > 0


@pytest.mark.slow  # ~15 s on 2 cores: the suite's time budget (README, tests)
def test_grammars_in_flight_are_served_in_process(in_process_outputs,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Grammars reach the workers off the step loop. Here their acknowledgements are held
    back, then let in one per step: the requests whose grammar is not on their worker yet
    are served in process (barrier and walk) in the same builds as those already on the
    workers, then move to the workers; the outputs equal the in-process run, and the step
    loop never serialized a grammar."""
    from structspec.grammar.worker_pool import MaskWorkerPool
    from structspec.scheduler import grammar_service

    params = cut_params()
    ref = in_process_outputs("ngram")
    calls = [0]

    def one_ack_per_step(self: MaskWorkerPool) -> int:
        calls[0] += 1
        if calls[0] <= 3:
            return 0
        ship = self.shipping
        for w, flight in enumerate(ship.in_flight):  # slowed on purpose
            if flight and self._ship_conns[w].poll(5):  # noqa: SLF001
                ship.acknowledge(w, *self._ship_conns[w].recv())  # noqa: SLF001
                return 1
        return 0

    local_rows: list[tuple[int, int]] = []  # per pooled build: (rows on workers, local rows)
    pooled = grammar_service.build_grammar_vocab_mask_pooled

    def recording_pooled(pool, requests, *args, local=(), **kwargs):  # type: ignore[no-untyped-def]
        local_rows.append((sum(q is not None for q in requests), len(local)))
        return pooled(pool, requests, *args, local=local, **kwargs)

    monkeypatch.setattr(MaskWorkerPool, "collect_shipped", one_ack_per_step)
    monkeypatch.setattr(grammar_service, "build_grammar_vocab_mask_pooled", recording_pooled)
    with pool_llm(**SPEC_CONFIGS["ngram"]({})) as llm:
        pool = llm.engine.scheduler.mask_pool
        got = llm.generate(PROMPTS[:8], params)
        assert llm.engine.scheduler.mask_pool is pool and pool.num_shipped >= 3
        assert pool.ship_ms < 50, pool.ship_ms  # placing and queueing only
    assert any(w and n for w, n in local_rows), local_rows  # mixed builds happened
    assert any(w and not n for w, n in local_rows), local_rows  # and all-worker ones later
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("when", [pytest.param("before_build", marks=pytest.mark.slow),
                                  "after_verdicts",
                                  pytest.param("while_shipping", marks=pytest.mark.slow)])
def test_dead_mask_worker_falls_back_in_process(request: pytest.FixtureRequest,
                                                in_process_outputs, when: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask worker killed mid-run (before a build's messages, after its mirrors' verdicts
    were applied and before its walks arrive, or while grammars are on their way to it): the
    engine drops the pool, its host matchers replay what the mirrors had advanced, and every
    output equals the in-process run."""
    from structspec.grammar.worker_pool import MaskWorkerPool
    from structspec.scheduler.grammar_service import GrammarService

    params = cut_params()
    ref = in_process_outputs("ngram")
    # after_verdicts: the shared pool engine (this is its last test); the others need
    # grammars still on their way to fresh workers
    llm_context = (contextlib.nullcontext(request.getfixturevalue("ngram_pool_llm"))
                   if when == "after_verdicts" else pool_llm(**SPEC_CONFIGS["ngram"]({})))
    with llm_context as llm:
        sched = llm.engine.scheduler
        pool = sched.mask_pool
        assert pool is not None  # pool_llm checked it; narrows the type
        calls = [0]

        def kill_worker() -> None:
            pool._procs[0].kill()  # noqa: SLF001 - the test plays a crashed worker
            pool._procs[0].wait()  # noqa: SLF001

        if when == "before_build":
            build = MaskWorkerPool.build

            def build_then_die(self: MaskWorkerPool, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
                calls[0] += 1
                if calls[0] == 3:
                    kill_worker()
                return build(self, *args, **kwargs)

            monkeypatch.setattr(MaskWorkerPool, "build", build_then_die)
        elif when == "while_shipping":
            # the first step's acknowledgements are not read yet: grammars are in flight
            collect = MaskWorkerPool.collect_shipped

            def die_then_collect(self: MaskWorkerPool) -> int:
                calls[0] += 1
                if calls[0] == 1:
                    kill_worker()
                    calls[0] = 3  # the count the other cases reach
                return collect(self)

            monkeypatch.setattr(MaskWorkerPool, "collect_shipped", die_then_collect)
        else:
            apply = GrammarService._apply_verdicts

            def apply_then_die(reqs, result) -> None:  # type: ignore[no-untyped-def]
                apply(reqs, result)
                calls[0] += 1
                if calls[0] == 3:
                    kill_worker()

            monkeypatch.setattr(GrammarService, "_apply_verdicts", staticmethod(apply_then_die))
        got = llm.generate(PROMPTS[:8], params)
        # the failed pool was dropped; a new one was started in the background
        assert calls[0] >= 3 and sched.mask_pool is not pool
        assert sched.grammar.num_respawns == 1
        if when == "before_build":  # the new pool takes over and serves the same outputs
            respawn = sched.grammar._respawn  # noqa: SLF001
            if respawn is not None:
                respawn.result(timeout=120)
            again = llm.generate(PROMPTS[:8], params)
            assert sched.mask_pool is not None and sched.mask_pool.num_builds > 0
            for a, b in zip(ref, again, strict=True):
                assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason


def test_synchronous_grammar_fallback_matches_overlap(make_llm, in_process_outputs) -> None:
    """A drafter without ``supports_grammar_overlap`` gets its mask built before the verify
    launch; outputs equal the overlapped path, and the step timer sees every verify step."""
    ref = in_process_outputs("ngram")
    llm = make_llm(**SPEC_CONFIGS["ngram"]({}))
    drafter = llm.engine.drafter
    drafter.supports_grammar_overlap = False  # instance attribute shadows the class flag
    try:
        llm.engine.step_stats(reset=True)
        got = llm.generate(PROMPTS[:8], cut_params())
        stats = llm.engine.step_stats()
    finally:
        del drafter.supports_grammar_overlap
    for a, b in zip(ref, got, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.finish_reason == b.finish_reason and a.stop_reason == b.stop_reason
    assert stats["steps"] > 0 and stats["cpu_mask_ms"] > 0 and stats["wall_ms"] > 0
