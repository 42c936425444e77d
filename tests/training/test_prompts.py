"""The distillation prompt set: held-out data stays out, benchmarks' workloads unchanged."""

from __future__ import annotations

import ast
import hashlib
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest

from structspec.constraints import JsonSchemaConstraint
from structspec.core import RequestOutput
from structspec.training import prompts as P
from structspec.training.prompts import (
    TrainPrompt,
    build_prompt_set,
    interleaved_order,
    training_schema_cases,
)
from structspec.training.sharegpt import split_held_out
from structspec.training.workloads import (
    EXTRACTION_SCHEMA,
    extraction_prompts,
    maskbench_cases,
    maskbench_eval_cases,
    schema_prompt,
)

REPO = Path(__file__).resolve().parents[2]
MASKBENCH = REPO / "tests" / "data" / "maskbench"


def _canon(schema: Any) -> str:
    return json.dumps(schema, sort_keys=True)


@pytest.mark.parametrize("kw", [dict(num_sharegpt=0, num_extraction=0, num_schema=0, seed=0)])
def test_empty_prompt_set_is_an_error(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="empty prompt set"):
        build_prompt_set(**kw)


@pytest.mark.parametrize(("name", "value"), [("num_schema", -1), ("seed", -3),
                                             ("num_extraction", 2.0), ("num_sharegpt", True)])
def test_bad_counts_name_the_argument(name: str, value: Any) -> None:
    kw: dict[str, Any] = dict(num_sharegpt=0, num_extraction=1, num_schema=0, seed=0)
    kw[name] = value
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 0"):
        build_prompt_set(**kw)


def test_missing_maskbench_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="maskbench_dir .* is not a folder"):
        build_prompt_set(num_sharegpt=0, num_extraction=0, num_schema=1, seed=0,
                         maskbench_dir=tmp_path / "none")


def _maskbench_e2e_schemas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           skip_slow_compile: bool) -> list[Any]:
    """The schemas ``benchmarks/maskbench_e2e.py`` sends with its default limit, from the
    benchmark's own ``run`` (its LLM replaced by one that records the requests)."""
    import benchmarks.maskbench_e2e as e2e

    sent: list[Any] = []

    class RecordingLLM:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def generate(self, prompts: list[str], params: list[Any],
                     **kw: Any) -> list[RequestOutput]:
            sent.extend(p.grammar.schema for p in params)
            return [RequestOutput.error_output(f"r{i}", "not run") for i in range(len(prompts))]

    monkeypatch.setattr(e2e, "LLM", RecordingLLM)
    defaults = {a.dest: a.default for a in _e2e_parser_actions(e2e)}
    defaults.update(data=str(MASKBENCH), out=str(tmp_path / "out.jsonl"),
                    skip_slow_compile=skip_slow_compile)
    e2e.run(Namespace(**defaults))
    return sent


def _e2e_parser_actions(e2e: Any) -> list[Any]:
    """The benchmark's argparse actions (its defaults, e.g. ``--limit 120``), read by running
    ``main`` up to ``parse_args``."""
    import argparse

    captured: list[Any] = []

    def fake_parse(self: argparse.ArgumentParser, *a: Any, **k: Any) -> None:
        captured.extend(act for act in self._actions if act.dest != "help")
        raise SystemExit(0)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", fake_parse)
        with pytest.raises(SystemExit):
            e2e.main()
    return captured


def test_schema_prompts_leave_out_what_maskbench_e2e_evaluates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    evaluated = [s for skip in (False, True)
                 for s in _maskbench_e2e_schemas(tmp_path, monkeypatch, skip)]
    assert len(evaluated) == 240  # 120 per run; the two runs differ in 3 cases
    evaluated_text = {_canon(s) for s in evaluated}
    pool = training_schema_cases(MASKBENCH)
    assert len(pool) == 218
    assert not {_canon(c["schema"]) for c in pool} & evaluated_text
    # every schema prompt training can build, each grammar under a pool schema
    prompts = build_prompt_set(num_sharegpt=0, num_extraction=0,
                               num_schema=len(pool) * P.SCHEMA_PROMPT_VARIANTS, seed=0)
    assert not {_canon(p.grammar.schema) for p in prompts} & evaluated_text
    assert len({p.messages[0]["content"] for p in prompts}) == len(prompts)  # all distinct
    # the first round is the benchmark's own prompt, over each pool schema once
    first = prompts[:len(pool)]
    assert [p.messages[0]["content"] for p in first] == [
        schema_prompt(p.grammar.schema) for p in first]
    assert sorted(_canon(p.grammar.schema) for p in first) == sorted(
        _canon(c["schema"]) for c in pool)
    assert all(isinstance(p.grammar, JsonSchemaConstraint) and not p.grammar.strict
               and p.source == "schema" for p in prompts)
    # asking for one more than there are says how many there are
    most = len(prompts)
    with pytest.raises(ValueError, match=f"num_schema={most + 1} but only {most} distinct "
                                         "prompts of that source are available$"):
        P._take(iter(prompts), most + 1, lambda batch: [True] * len(batch), "num_schema")


def test_maskbench_eval_selection_is_the_old_inline_one() -> None:
    """``maskbench_e2e.run`` used to select its cases inline; the shared function picks the
    same ones."""
    timing = json.loads((MASKBENCH / "compile_seconds.json").read_text())
    for skip in (False, True):
        slow = {k for k, v in timing.items() if v > 5.0} if skip else set()
        old = [c for c in maskbench_cases(MASKBENCH) if c.get("_name", "") not in slow][:120]
        assert maskbench_eval_cases(MASKBENCH, 120, skip_slow_compile=skip) == old


def test_benchmark_workloads_unchanged() -> None:
    """Seed for seed, the generators moved out of benchmarks/workloads.py give what they gave
    there (digests taken from the old module), and that module re-exports them."""
    import benchmarks.workloads as bw

    h = hashlib.sha256()
    for seed in (0, 1, 3, 7):
        h.update(json.dumps(bw.extraction_prompts(300, seed=seed)).encode())
    assert h.hexdigest() == "0b21bc04158d22e2eda6734137174c2c209914a27d7256d231110752e71966c1"
    texts = [bw.schema_prompt(c["schema"]) for c in bw.maskbench_cases(MASKBENCH)]
    assert hashlib.sha256(json.dumps(texts).encode()).hexdigest() == (
        "a011098a806d58021676c06a62e7fe03137e2308c0578517652b7b2d4e586522")
    assert bw.extraction_prompts is extraction_prompts and bw.EXTRACTION_SCHEMA is EXTRACTION_SCHEMA


def _extraction_seeds_in_repo() -> dict[str, set[int]]:
    """Every seed passed to ``extraction_prompts`` in benchmarks/ and tests/ (this package's
    own tests aside): a literal, the default 0, or a parameter's literal default."""
    found: dict[str, set[int]] = {}
    files = sorted(REPO.glob("benchmarks/*.py")) + sorted(REPO.glob("tests/**/*.py"))
    for path in files:
        if path.is_relative_to(REPO / "tests" / "training"):
            continue
        tree = ast.parse(path.read_text())
        defaults: dict[str, set[int]] = {}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args[len(node.args.args) - len(node.args.defaults):]
                for arg, default in zip(args, node.args.defaults, strict=True):
                    if isinstance(default, ast.Constant) and isinstance(default.value, int):
                        defaults.setdefault(arg.arg, set()).add(default.value)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name != "extraction_prompts":
                continue
            arg = next((k.value for k in node.keywords if k.arg == "seed"),
                       node.args[1] if len(node.args) > 1 else ast.Constant(0))
            rel = str(path.relative_to(REPO))
            if isinstance(arg, ast.Constant):
                found.setdefault(rel, set()).add(arg.value)
            elif isinstance(arg, ast.Name) and arg.id in defaults:
                found.setdefault(rel, set()).update(defaults[arg.id])
            else:
                raise AssertionError(f"{rel}:{node.lineno}: extraction_prompts seed "
                                     f"{ast.unparse(arg)} is not a literal")
    return found


def test_extraction_prompts_are_not_the_benchmarks() -> None:
    seeds = _extraction_seeds_in_repo()
    assert "benchmarks/offline.py" in seeds and "benchmarks/grammar_overlap.py" in seeds
    used = set().union(*seeds.values())
    assert used <= set(P.BENCHMARK_EXTRACTION_SEEDS), seeds
    assert max(P.BENCHMARK_EXTRACTION_SEEDS) < P.EXTRACTION_SEED_OFFSET
    prompts = build_prompt_set(num_sharegpt=0, num_extraction=1500, num_schema=0, seed=0)
    texts = [p.messages[0]["content"] for p in prompts]
    assert len(set(texts)) == 1500
    bench = {t for s in P.BENCHMARK_EXTRACTION_SEEDS for t, _ in extraction_prompts(4096, seed=s)}
    assert not bench & set(texts)
    assert all(p.grammar == JsonSchemaConstraint(EXTRACTION_SCHEMA) for p in prompts)
    # deterministic, a prefix of a longer draw, and another seed draws others
    again = build_prompt_set(num_sharegpt=0, num_extraction=20, num_schema=0, seed=0)
    assert again == prompts[:20]
    other = build_prompt_set(num_sharegpt=0, num_extraction=20, num_schema=0, seed=1)
    assert not {p.messages[0]["content"] for p in other} & set(texts)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from structspec.models.default_model import resolve_model_path
    from structspec.models.tokenizer import Tokenizer

    try:
        return Tokenizer(resolve_model_path(None))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_sharegpt_prompts_train_side_only_and_capped(tmp_path: Path, tokenizer: Any) -> None:
    firsts = [f"Question {i}: what is {i} plus {i}?" for i in range(60)]
    firsts[5] = "word " * 3000  # over the 1024-token cap (and longer than its prefix check)
    firsts[7] = firsts[8]  # a duplicate
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": v}]}
             for i, v in enumerate(firsts)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs)[:-1])  # cut off before the closing bracket
    _, held = split_held_out(firsts, P.SHAREGPT_HELD_OUT_FRACTION, P.SHAREGPT_HELD_OUT_SEED)
    assert held  # 3 of the 59 distinct texts
    available = len(set(firsts) - set(held)) - (firsts[5] not in held)
    got = build_prompt_set(num_sharegpt=available, num_extraction=2, num_schema=2, seed=0,
                           tokenizer=tokenizer, sharegpt_path=path)
    assert [p.source for p in got] == ["sharegpt"] * available + ["extraction"] * 2 + [
        "schema"] * 2
    texts = [p.messages[0]["content"] for p in got[:available]]
    assert len(set(texts)) == available and not set(texts) & set(held)
    assert firsts[5] not in texts and all(p.grammar is None for p in got[:available])
    with pytest.raises(ValueError, match=f"num_sharegpt={available + 1} but only {available} "
                                         "distinct prompts .* \\(1 more are over the length cap\\)"):
        build_prompt_set(num_sharegpt=available + 1, num_extraction=0, num_schema=0, seed=0,
                         tokenizer=tokenizer, sharegpt_path=path)
    # the seed reorders the draw, the set is the train side either way
    other = build_prompt_set(num_sharegpt=available, num_extraction=0, num_schema=0, seed=1,
                             tokenizer=tokenizer, sharegpt_path=path)
    assert [p.messages[0]["content"] for p in other] != texts
    assert sorted(p.messages[0]["content"] for p in other) == sorted(texts)


def test_sharegpt_later_turns_leave_held_out_conversations_out(tmp_path: Path) -> None:
    """Later turns come only from train-side conversations: every part of a conversation whose
    first turn is held out is skipped, as are first-turn texts, short turns and duplicates;
    the held-out source is the held-out first turns."""
    firsts = [f"Question {i}: what is {i} times {i} exactly?" for i in range(60)]
    _, held = split_held_out(firsts, P.SHAREGPT_HELD_OUT_FRACTION, P.SHAREGPT_HELD_OUT_SEED)
    held_i = [i for i, f in enumerate(firsts) if f in held]
    assert held_i

    def later(i: int, k: int) -> str:
        return f"And a follow-up number {k} of conversation {i}, please?"

    convs: list[dict[str, Any]] = []
    for i, f in enumerate(firsts):
        convs.append({"id": f"c{i}_0", "conversations": [
            {"from": "human", "value": f}, {"from": "gpt", "value": "an answer"},
            {"from": "human", "value": later(i, 1)}, {"from": "gpt", "value": "another"},
            {"from": "human", "value": "thanks"},  # under the length floor
            {"from": "human", "value": firsts[(i + 1) % 60]}]})  # a first turn's text
        # the conversation's second part opens with the assistant: its human turns are later
        convs.append({"id": f"c{i}_3", "conversations": [
            {"from": "gpt", "value": "continued"}, {"from": "human", "value": later(i, 2)},
            {"from": "human", "value": later(i, 1)}]})  # a duplicate
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    texts = P.sharegpt_later_turn_prompts(path)
    train_i = [i for i in range(60) if i not in held_i]
    assert sorted(texts) == sorted(later(i, k) for i in train_i for k in (1, 2))
    got = build_prompt_set(num_sharegpt=3, num_extraction=0, num_schema=0, seed=0,
                           num_sharegpt_later=len(texts), sharegpt_path=path)
    assert [p.source for p in got] == ["sharegpt"] * 3 + ["sharegpt_later"] * len(texts)
    assert sorted(p.messages[0]["content"] for p in got[3:]) == sorted(texts)
    assert all(p.grammar is None for p in got)
    with pytest.raises(ValueError, match=f"num_sharegpt_later={len(texts) + 1} but only"):
        build_prompt_set(num_sharegpt=0, num_extraction=0, num_schema=0, seed=0,
                         num_sharegpt_later=len(texts) + 1, sharegpt_path=path)
    with pytest.raises(ValueError, match="num_sharegpt_later must be an integer >= 0"):
        build_prompt_set(num_sharegpt=1, num_extraction=0, num_schema=0, seed=0,
                         num_sharegpt_later=-1, sharegpt_path=path)
    # the held-out source: exactly the held-out first turns, last first, whatever the seed
    for seed in (0, 5):
        ev = build_prompt_set(num_sharegpt=0, num_extraction=0, num_schema=0, seed=seed,
                              num_sharegpt_held_out=len(held_i), sharegpt_path=path)
        assert [p.messages[0]["content"] for p in ev] == [firsts[i] for i in held_i[::-1]]
        assert {p.source for p in ev} == {"sharegpt_held_out"}


def test_sharegpt_later_turns_leave_out_held_out_text_seen_elsewhere(tmp_path: Path) -> None:
    """A train-side conversation's later turn is left out when it repeats a human turn of a
    held-out conversation or quotes a held-out first turn of 40+ characters; a short held-out
    first turn (a stock phrase) inside a later turn does not count."""
    firsts = ([f"Question {i}: what is {i} times {i} exactly, in full detail?" for i in range(60)]
              + [f"ok {k}" for k in range(60)])
    _, held = split_held_out(firsts, P.SHAREGPT_HELD_OUT_FRACTION, P.SHAREGPT_HELD_OUT_SEED)
    long_held = next(f for f in held if f.startswith("Question"))
    short_held = next(f for f in held if f.startswith("ok "))  # the split is fixed: "ok 5"
    assert len(short_held) < P.SHAREGPT_HELD_OUT_QUOTE_MIN_CHARS <= len(long_held)
    train_first = next(f for f in firsts if f not in held)
    template = "Now I will give you some examples of prompts to imitate."
    quoting = f"Earlier someone asked: {long_held} Answer that again."
    stock = f"{short_held} then, and now a longer follow-up question"
    kept = "A later turn that only the train-side conversation has."

    def conv(cid: str, *texts: str) -> dict[str, Any]:
        return {"id": cid, "conversations": [{"from": "human", "value": t} for t in texts]}

    convs = [conv("held_0", long_held, template),
             conv("train_0", train_first, template, quoting, kept, stock)]
    convs += [conv(f"c{i}", f) for i, f in enumerate(firsts) if f not in (long_held, train_first)]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    assert P.sharegpt_later_turn_prompts(path) == [kept, stock]


def test_train_prompt_checks() -> None:
    p = TrainPrompt([{"role": "user", "content": "hi"}], None, "sharegpt")
    assert isinstance(p.messages, tuple)
    with pytest.raises(ValueError, match="at least one message"):
        TrainPrompt((), None, "sharegpt")
    with pytest.raises(ValueError, match=r"messages\[0\] must be a dict"):
        TrainPrompt(({"role": "user"},), None, "sharegpt")
    with pytest.raises(ValueError, match="source must be one of"):
        TrainPrompt.user("hi", None, "web")


def test_interleaved_order_mixes_sources_in_proportion() -> None:
    prompts = ([TrainPrompt.user(f"s{i}", None, "sharegpt") for i in range(10)]
               + [TrainPrompt.user(f"e{i}", None, "extraction") for i in range(2)]
               + [TrainPrompt.user(f"c{i}", None, "schema") for i in range(3)])
    order = interleaved_order(prompts)
    assert sorted(order) == list(range(15))
    for source in ("sharegpt", "extraction", "schema"):  # each source in its own order
        own = [i for i in order if prompts[i].source == source]
        assert own == sorted(own)
    first = {prompts[i].source for i in order[:6]}
    assert first == {"sharegpt", "extraction", "schema"}  # a cut run holds every source
    assert interleaved_order(prompts[:3]) == [0, 1, 2]
