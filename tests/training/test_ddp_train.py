"""The train stage under ``torchrun`` (DistributedDataParallel, gloo on the CPU): two processes
give the same steps as one process accumulating the same global batch (gradient averaging),
the loss falls, rank 0 alone writes, all ranks stop at rank 0's step, and the checkpoint
resumes in one process; plus the launch checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from structspec.training.batch_stream import BatchStream, total_steps
from structspec.training.distributed import DistContext, rank_device, reduce_step
from structspec.training.train_config import LOG_FILE, TrainEagleConfig
from structspec.training.train_eagle import train_eagle

ROOT = Path(__file__).resolve().parents[2]


def _config(out: Path, model: Path, seqs: Path, **kw: Any) -> TrainEagleConfig:
    base: dict[str, Any] = dict(
        out=str(out), model=str(model), stage="train", sequences=str(seqs), steps=8,
        batch_tokens=128, max_seq_len=64, ttt_steps=2, lr=1e-2, warmup_steps=2,
        checkpoint_every=0, device="cpu", dtype="float32", export_dtype="float32",
        progress=False, draft_vocab_size=48)
    return TrainEagleConfig(**{**base, **kw})


def _log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines()]


def _torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), "-m", "structspec", "train-eagle", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def test_batch_stream_splits_a_step_like_accumulation() -> None:
    lengths = [10 + (7 * i) % 50 for i in range(40)]
    kw = dict(batch_tokens=128, max_len=64, seed=1)
    ranks = [BatchStream(lengths, **kw) for _ in range(2)]
    one = BatchStream(lengths, **kw)
    for _ in range(9):  # past an epoch's end: a step may straddle two epochs
        mine = [s.take_step(2, r, 1)[0] for r, s in enumerate(ranks)]
        assert mine == one.take_step(1, 0, 2)
        assert not set(mine[0]) & set(mine[1])
    assert ranks[0].state() == ranks[1].state() == one.state() and one.epoch >= 1
    resumed = BatchStream(lengths, **kw)
    resumed.load(one.state())
    assert resumed.take_step(1, 0, 3) == one.take_step(1, 0, 3)
    per_epoch = len(BatchStream(lengths, **kw).plan)
    assert total_steps(0, 2, lengths, batches_per_step=3, **kw) == -(-2 * per_epoch // 3)
    assert total_steps(5, 2, lengths, batches_per_step=3, **kw) == 5


def test_launch_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    from structspec.cli import main

    for flag, field in (("--grad-accum", "grad_accum"), ("--data-parallel", "data_parallel")):
        assert main(["train-eagle", "--out", str(tmp_path), flag, "0"]) == 2
        assert f"{flag}: {field}=0: must be >= 1" in capsys.readouterr().err
    assert rank_device("cpu", 3) == "cpu"
    with pytest.raises(ValueError, match=r"^device='cuda:1': under torchrun"):
        rank_device("cuda:1", 0)
    values = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert reduce_step(values, True, DistContext()) == (values, True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^stage='data': under torchrun \(WORLD_SIZE=2\)"):
        train_eagle(TrainEagleConfig(out=str(tmp_path), stage="data"))
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE='two'"):
        train_eagle(TrainEagleConfig(out=str(tmp_path), stage="train"))


@pytest.mark.slow  # ~13 s on 2 cores: two torch.distributed processes
def test_two_processes_equal_one_with_accumulation_and_resume(
        small_dir: Path, small_seqs: Path, tmp_path: Path) -> None:
    """gloo, 2 processes x 1 batch a step == 1 process x 2 accumulated batches: the same
    losses and agreement step by step (so the gradients were averaged), the same rows and
    tokens; the 2-process run stops at step 5 on every rank (rank 0's decision) and its
    checkpoint resumes in one process to the reference's final weights."""
    ref = _config(tmp_path / "ref", small_dir, small_seqs, grad_accum=2)
    train_eagle(ref)
    a = _log(tmp_path / "ref")
    assert [r["step"] for r in a] == list(range(1, 9))
    assert sum(r["loss"] for r in a[-3:]) < 0.8 * sum(r["loss"] for r in a[:3])

    ddp_out = tmp_path / "ddp"
    run = _torchrun(["--out", str(ddp_out), "--model", str(small_dir), "--sequences",
                     str(small_seqs), "--steps", "8", "--stop-at-step", "5",
                     "--batch-tokens", "128", "--max-seq-len", "64", "--ttt-steps", "2",
                     "--lr", "1e-2", "--warmup-steps", "2", "--checkpoint-every", "0",
                     "--device", "cpu", "--dtype", "float32", "--export-dtype", "float32",
                     "--draft-vocab-size", "48", "--no-progress"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines() == [str(ddp_out)]  # rank 0 alone prints
    assert run.stderr.count("train-eagle train: step 5/8") == 1
    assert "on 2 processes" in run.stderr
    b = _log(ddp_out)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5]
    for ra, rb in zip(a, b, strict=False):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4), (ra, rb)
        # the mean of the ranks' gradients, not their sum (Adam alone would hide a scale)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-3), (ra, rb)
        assert rb["acc"] == pytest.approx(ra["acc"], abs=0.02), (ra, rb)
        assert (rb["rows"], rb["tokens"]) == (ra["rows"], ra["tokens"])

    with pytest.raises(ValueError, match=r"batches_per_step is 2, this run's is 1"):
        train_eagle(replace(ref, out=str(ddp_out), grad_accum=1, resume=True))
    train_eagle(replace(ref, out=str(ddp_out), resume=True))
    c = _log(ddp_out)
    assert [r["step"] for r in c] == list(range(1, 9))
    for ra, rc in zip(a[5:], c[5:], strict=True):
        assert rc["loss"] == pytest.approx(ra["loss"], rel=1e-4), (ra, rc)
    wa = load_file(str(tmp_path / "ref" / "model.safetensors"))
    wc = load_file(str(ddp_out / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wc[k], wa[k], atol=1e-4, rtol=1e-3)
