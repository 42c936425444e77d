"""The train-eagle data stage never loses work: shards survive a kill, ``resume`` completes the
set exactly as an uninterrupted run, the time limit and SIGTERM stop and save, progress lines
appear without a bar, and a resume under other data options is refused."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import structspec.training.distill_progress as progress_module
from structspec import JsonSchemaConstraint
from structspec.training.data_shards import SHARD_PATTERN, read_shards
from structspec.training.data_stage import generate_data, summary_line
from structspec.training.prompts import TrainPrompt
from structspec.training.sequences import load_sequences
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig
from structspec.training.workloads import EXTRACTION_SCHEMA


def _prompts() -> list[TrainPrompt]:
    chat = [TrainPrompt.user(t, None, "sharegpt") for t in
            ("List three colors.", "Name a planet.", "Say hello in French.", "Count to three.")]
    extraction = [TrainPrompt.user(f"{n}, {a}, lives in Lisbon. Extract as JSON.",
                                   JsonSchemaConstraint(EXTRACTION_SCHEMA), "extraction")
                  for n, a in (("Ana Silva", 30), ("Rui Costa", 41))]
    schema = [TrainPrompt.user(f"Give a JSON object with key k{i}.",
                               JsonSchemaConstraint({"type": "object", "properties": {
                                   f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}),
                               "schema") for i in range(2)]
    # refused by the grammar (strict: 'not' cannot be enforced): finishes skipped
    bad = TrainPrompt.user("Any JSON.", JsonSchemaConstraint({"type": "object", "not": {}}),
                           "schema")
    return chat + extraction + schema + [bad]


def _config(out: Path, **kw: Any) -> TrainEagleConfig:
    base: dict[str, Any] = dict(out=str(out), stage="data", max_tokens=4, gen_batch_size=1,
                                progress=False)
    return TrainEagleConfig(**{**base, **kw})


def _wrap_step(monkeypatch: pytest.MonkeyPatch, llm: Any,
               before: Callable[[int], None]) -> None:
    """``before(n)`` runs ahead of the engine's n-th step (1-based) of this test."""
    step = llm.engine.step
    calls = [0]

    def wrapped() -> Any:
        calls[0] += 1
        before(calls[0])
        return step()

    monkeypatch.setattr(llm.engine, "step", wrapped)


def _shards(out: Path) -> list[Path]:
    return sorted(out.glob(SHARD_PATTERN))


def test_shards_survive_a_kill_and_resume_equals_an_uninterrupted_run(
        make_llm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm()
    prompts = _prompts()
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    full_dir.mkdir()
    cut_dir.mkdir()
    full = generate_data(llm, prompts, _config(full_dir), full_dir, start_s=0.0, shard_every=2)
    assert (full.num_done, full.num_sequences, full.num_skipped, full.stopped) == (9, 8, 1, "")
    expected = load_sequences(full_dir / SEQUENCES_FILE)
    assert len(expected) == 8 and {s.source for s in expected} == {
        "sharegpt", "extraction", "schema"}

    def kill(n: int) -> None:
        if len(_shards(cut_dir)) >= 2:  # two shards on disk when the process "dies"
            raise KeyboardInterrupt

    _wrap_step(monkeypatch, llm, kill)
    with pytest.raises(KeyboardInterrupt):
        generate_data(llm, prompts, _config(cut_dir), cut_dir, start_s=0.0, shard_every=2)
    monkeypatch.undo()
    assert not (cut_dir / SEQUENCES_FILE).exists()
    saved = read_shards(cut_dir)
    assert 4 <= len(saved.done) < 9
    # the interleaved order: a cut run already holds every source
    assert {prompts[i].source for i in saved.done} == {"sharegpt", "extraction", "schema"}
    for i, seq in saved.sequences.items():  # prompt 8 (the bad one) is the only skipped
        assert seq == expected[i]

    # another run into the same folder must say --resume; other options are refused by name
    with pytest.raises(ValueError, match=r"^resume: .*pass --resume"):
        generate_data(llm, prompts, _config(cut_dir), cut_dir, start_s=0.0)
    with pytest.raises(ValueError, match=r"^max_tokens: .*max_tokens=4 there, 5 now"):
        generate_data(llm, prompts, _config(cut_dir, resume=True, max_tokens=5), cut_dir,
                      start_s=0.0)
    with pytest.raises(ValueError, match=r"^prompt_set: .*prompt set differs"):
        generate_data(llm, prompts[::-1], _config(cut_dir, resume=True), cut_dir, start_s=0.0)

    resumed = generate_data(llm, prompts, _config(cut_dir, resume=True), cut_dir, start_s=0.0,
                            shard_every=2)
    assert load_sequences(cut_dir / SEQUENCES_FILE) == expected
    assert (resumed.num_done, resumed.num_sequences, resumed.num_skipped) == (9, 8, 1)
    assert resumed.new_sequences == 8 - len(saved.sequences)  # nothing done twice
    # a resume of a complete set only merges
    again = generate_data(llm, prompts, _config(cut_dir, resume=True), cut_dir, start_s=0.0)
    assert again.new_sequences == 0 and load_sequences(cut_dir / SEQUENCES_FILE) == expected


def test_time_limit_and_sigterm_stop_save_and_report(
        make_llm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A fake clock advances 1 s per engine step: the 7 s limit stops the run, which saves what
    finished and reports progress lines every 2 s (no bar: progress off); a SIGTERM stops
    the resumed run the same way; the last resume completes the set."""
    llm = make_llm()
    prompts = _prompts()
    now = [0.0]

    def tick(n: int) -> None:
        now[0] += 1.0

    monkeypatch.setattr(progress_module, "REPORT_INTERVAL_S", 2.0)
    _wrap_step(monkeypatch, llm, tick)
    cfg = _config(tmp_path, data_time_limit_s=7.0)
    res = generate_data(llm, prompts, cfg, tmp_path, start_s=0.0, clock=lambda: now[0],
                        shard_every=100)
    assert res.stopped == "time limit" and 0 < res.num_done < 9
    assert not llm.engine.has_unfinished_requests()  # the aborted requests are gone
    assert len(load_sequences(tmp_path / SEQUENCES_FILE)) == res.num_sequences
    assert len(read_shards(tmp_path).done) == res.num_done
    assert "stopped at the time limit 7 s: --resume continues" in summary_line(res, cfg)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("distill: ")]
    assert len(lines) >= 2, err  # periodic lines, then the final one
    assert "sequences/s" in lines[-1] and "response tokens/s" in lines[-1]
    assert "sharegpt " in lines[-1] and "schema " in lines[-1] and "stopped early" in lines[-1]

    done_before = res.num_done
    handler = signal.getsignal(signal.SIGTERM)
    monkeypatch.undo()

    def term(n: int) -> None:
        if n == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    _wrap_step(monkeypatch, llm, term)
    res = generate_data(llm, prompts, replace(cfg, resume=True, data_time_limit_s=0.0),
                        tmp_path, start_s=0.0, shard_every=100)
    assert signal.getsignal(signal.SIGTERM) == handler  # restored
    assert res.stopped == "SIGTERM" and done_before <= res.num_done < 9
    assert "resuming: " in capsys.readouterr().err
    monkeypatch.undo()
    res = generate_data(llm, prompts, replace(cfg, resume=True, data_time_limit_s=0.0),
                        tmp_path, start_s=0.0)
    assert (res.num_done, res.num_sequences, res.stopped) == (9, 8, "")
    assert "sharegpt finished" in capsys.readouterr().err  # a source's last prompt: a line
