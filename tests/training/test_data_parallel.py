"""``train-eagle --stage data --data-parallel N``: ranks answer disjoint prompts (index modulo
N) into shards named by rank, a resume works per rank and across another N, the merge equals a
one-process run, and N=2 CPU processes end to end give one engine's sequences."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from structspec.training.data_parallel import merge_results, plan_ranks, run_data_parallel
from structspec.training.data_shards import SHARD_PATTERN, read_shards, shard_path
from structspec.training.data_stage import generate_data
from structspec.training.data_worker import parent_gone
from structspec.training.distill import distill
from structspec.training.prompts import TrainPrompt, build_prompt_set
from structspec.training.sequences import load_sequences
from structspec.training.train_config import SEQUENCES_FILE, TrainEagleConfig
from structspec.training.train_eagle import train_eagle

TEXTS = ("List three colors.", "Name a planet.", "Say hello in French.", "Count to three.",
         "Name a fruit.", "What is two plus two?", "Spell cat.")


def _prompts() -> list[TrainPrompt]:
    return [TrainPrompt.user(t, None, "sharegpt") for t in TEXTS]


def _config(out: Path, **kw: Any) -> TrainEagleConfig:
    base: dict[str, Any] = dict(out=str(out), stage="data", max_tokens=5, gen_batch_size=2,
                                progress=False, device="cpu", dtype="float32")
    return TrainEagleConfig(**{**base, **kw})


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(SHARD_PATTERN))


def test_plan_ranks_round_robin_over_devices_and_clear_errors() -> None:
    launches = plan_ranks("auto", 2, cuda_devices=["3", "5", "7"], cores=32)
    assert [(la.rank, la.device, la.env["CUDA_VISIBLE_DEVICES"], la.grammar_workers)
            for la in launches] == [(0, "cuda", "3", 8), (1, "cuda", "5", 8)]
    assert plan_ranks("cuda", 8, cuda_devices=[str(i) for i in range(8)],
                      cores=16)[7].grammar_workers == 0  # 2 cores a rank: grammar in process
    cpu = plan_ranks("auto", 2, cuda_devices=[], cores=8)
    assert [la.device for la in cpu] == ["cpu", "cpu"]
    assert all("CUDA_VISIBLE_DEVICES" not in la.env for la in cpu)
    # more ranks than GPUs: round-robin, several engines share a GPU
    shared = plan_ranks("cuda", 5, cuda_devices=["0", "1"], cores=40)
    assert [la.env["CUDA_VISIBLE_DEVICES"] for la in shared] == ["0", "1", "0", "1", "0"]
    assert [la.grammar_workers for la in shared] == [4] * 5
    with pytest.raises(ValueError, match=r"^device='cuda' with data_parallel=4: no CUDA"):
        plan_ranks("cuda", 4, cuda_devices=[], cores=8)
    with pytest.raises(ValueError, match=r"^device='cuda:1': --data-parallel"):
        plan_ranks("cuda:1", 2, cuda_devices=["0", "1"], cores=8)
    assert parent_gone(os.getppid())() == "" and parent_gone(-1)() == "parent exited"


def test_ranks_split_prompts_resume_across_n_and_merge(tiny_llm: Any, tmp_path: Path) -> None:
    prompts = _prompts()
    one, split, mixed = tmp_path / "one", tmp_path / "split", tmp_path / "mixed"
    for d in (one, split, mixed):
        d.mkdir()
    generate_data(tiny_llm, prompts, _config(one), one, start_s=0.0)
    expected = load_sequences(one / SEQUENCES_FILE)
    assert len(expected) == len(TEXTS)

    # two ranks: disjoint halves (index % 2), shards named by rank, no merged file by a rank
    r1 = generate_data(tiny_llm, prompts, _config(split), split, start_s=0.0, rank=1, world=2)
    assert (r1.new_sequences, r1.num_done) == (3, 3) and not (split / SEQUENCES_FILE).exists()
    assert _names(split) == [shard_path(split, 0, 1).name]
    assert set(read_shards(split).sequences) == {1, 3, 5}
    # rank 0 resumes into the same folder (it reads rank 1's shards and keeps to its own)
    r0 = generate_data(tiny_llm, prompts, _config(split, resume=True), split, start_s=0.0,
                       rank=0, world=2)
    assert r0.new_sequences == 4 and r0.num_done == len(TEXTS)
    merged = merge_results([r0, r1], split)
    assert (merged.num_sequences, merged.new_sequences, merged.ranks) == (7, 7, 2)
    assert load_sequences(split / SEQUENCES_FILE) == expected

    # a rank's shards, then a one-process resume finishes the rest: the same file
    generate_data(tiny_llm, prompts, _config(mixed), mixed, start_s=0.0, rank=1, world=2)
    res = generate_data(tiny_llm, prompts, _config(mixed, resume=True), mixed, start_s=0.0)
    assert res.new_sequences == 4 and load_sequences(mixed / SEQUENCES_FILE) == expected
    assert _names(mixed) == [shard_path(mixed, 0).name, shard_path(mixed, 0, 1).name]
    assert read_shards(mixed).next_number(1) == 1 and read_shards(mixed).next_number() == 1

    # the parent refuses shards without --resume before starting any rank
    with pytest.raises(ValueError, match=r"^resume: .*pass --resume"):
        run_data_parallel(_config(mixed, data_parallel=2), mixed)
    with pytest.raises(ValueError, match=r"^rank=2: expected 0 <= rank < world=2"):
        generate_data(tiny_llm, prompts, _config(mixed, resume=True), mixed, start_s=0.0,
                      rank=2, world=2)


@pytest.mark.slow  # ~12-20 s of process spawns; the rank split itself is covered above in-process
def test_two_cpu_processes_equal_one(tiny_dir: Path, tiny_llm: Any, tmp_path: Path,
                                     capfd: pytest.CaptureFixture[str]) -> None:
    """``--data-parallel 2`` on the CPU: two engine processes, lines prefixed by rank, the
    merged file equals one engine's answers to the same prompt set."""
    cfg = _config(tmp_path, model=str(tiny_dir), num_sharegpt=6, num_extraction=0,
                  num_schema=0, data_parallel=2)
    path = train_eagle(cfg)
    assert path == tmp_path / SEQUENCES_FILE
    prompts = build_prompt_set(num_sharegpt=6, num_extraction=0, num_schema=0, seed=0,
                               tokenizer=tiny_llm.tokenizer)
    seqs = distill(tiny_llm, prompts, max_tokens=cfg.max_tokens, batch_size=4,
                   progress=False)
    assert load_sequences(path) == seqs and len(seqs) >= 4
    names = _names(tmp_path)
    assert any("rank0-" in n for n in names) and any("rank1-" in n for n in names)
    err = capfd.readouterr().err
    assert "[data rank 0/2] distill: 3/3 done" in err and "[data rank 1/2] distill: " in err
    assert "prompts done" in err and "on 2 ranks" in err
