"""``structspec train-eagle``: TTT numerics against the inference head, a CPU smoke run whose
loss falls and whose head drafts losslessly, exact resume, export / load round trips, and the
errors of bad inputs."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from structspec.core import SamplingParams
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.models.eagle_head import load_eagle_head
from structspec.models.loader import load_model
from structspec.training.cli_train import add_train_eagle_parser
from structspec.training.export import export_eagle3_head
from structspec.training.features import TargetFeatureExtractor, default_aux_layers
from structspec.training.sequences import (
    HELD_OUT_SOURCE,
    TrainSequence,
    load_sequences,
    save_sequences,
)
from structspec.training.train_config import EVAL_LOG_FILE, LOG_FILE, TrainEagleConfig
from structspec.training.train_eagle import train_eagle
from structspec.training.trainer import build_head
from structspec.training.ttt import TTTForward

CPU = torch.device("cpu")


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def seq_file(tiny_llm: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny target's own greedy continuations of random prompts (self-distillation)."""
    prompts = _prompts(24)
    outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    seqs = [TrainSequence(tuple(p) + tuple(o.token_ids), len(p), "test")
            for p, o in zip(prompts, outs, strict=True)]
    path = tmp_path_factory.mktemp("seqs") / "sequences.npz"
    save_sequences(path, seqs)
    return path


def _config(out: Path, seq_file: Path, **kw: Any) -> TrainEagleConfig:
    base = dict(out=str(out), model=None, stage="train", sequences=str(seq_file), steps=6,
                batch_tokens=256, max_seq_len=64, ttt_steps=3, lr=3e-3, warmup_steps=2,
                checkpoint_every=0, device="cpu", dtype="float32", export_dtype="float32",
                progress=False)
    base.update(kw)
    return TrainEagleConfig(**base)


def _log(out: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines()]


def test_eval_sequences_logged_side_effect_free_and_held_out_refused(
        small_dir: Path, small_seqs: Path, tmp_path: Path) -> None:
    """``eval_sequences``: records at every ``eval_every`` step and at the end, the eval loss
    falls on sequences of the training distribution that were not trained on, and training
    with evaluation takes the same steps as without it; held-out-source sequences are refused
    as training data and accepted as eval data."""
    seqs = load_sequences(small_seqs)
    train_path, eval_path = tmp_path / "train.npz", tmp_path / "eval.npz"
    save_sequences(train_path, seqs[:24])
    save_sequences(eval_path, [replace(s, source=HELD_OUT_SOURCE) for s in seqs[24:]])
    base = _config(tmp_path / "plain", train_path, model=str(small_dir), steps=12, lr=1e-2)
    train_eagle(base)
    with_eval = replace(base, out=str(tmp_path / "eval"), eval_sequences=(str(eval_path),),
                        eval_every=4)
    train_eagle(with_eval)
    plain, evaluated = _log(tmp_path / "plain"), _log(tmp_path / "eval")
    for ra, rb in zip(plain, evaluated, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7)
        assert ra["acc"] == rb["acc"]
    ev = [json.loads(ln) for ln in (tmp_path / "eval" / EVAL_LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in ev] == [4, 8, 12]
    assert all(len(r["acc"]) == 3 and r["tokens"] > 0 for r in ev)
    assert ev[-1]["tokens"] == sum(min(len(s.token_ids), 64) for s in seqs[24:])
    assert ev[-1]["loss"] < ev[0]["loss"], ev
    # a cap on the eval tokens takes the file's first sequences, the same at every evaluation
    capped = replace(with_eval, out=str(tmp_path / "capped"), eval_max_tokens=40, steps=2,
                     eval_every=1)
    train_eagle(capped)
    cev = [json.loads(ln) for ln in
           (tmp_path / "capped" / EVAL_LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in cev] == [1, 2]
    assert cev[0]["tokens"] == cev[1]["tokens"] == min(len(seqs[24].token_ids), 64)
    with pytest.raises(ValueError, match=r"holds 8 sequences of held-out prompts .*"
                                         r"--eval-sequences"):
        train_eagle(replace(base, out=str(tmp_path / "bad"), sequences=(str(eval_path),)))
    with pytest.raises(FileNotFoundError, match="eval_sequences: .*missing.npz"):
        train_eagle(replace(base, out=str(tmp_path / "bad2"),
                            eval_sequences=(str(tmp_path / "missing.npz"),)))
    with pytest.raises(ValueError, match="eval_every=-1: must be >= 0"):
        train_eagle(replace(base, eval_every=-1))


def test_eval_log_consistent_over_stop_and_resume(small_dir: Path, small_seqs: Path,
                                                  tmp_path: Path) -> None:
    """A run stopped and resumed logs the uninterrupted run's evaluations (plus the one at the
    stop), a resumed run with nothing left to train adds no second record of its last step,
    and a new run without evaluation in the same folder leaves no earlier eval log behind."""
    seqs = load_sequences(small_seqs)
    train_path, eval_path = tmp_path / "train.npz", tmp_path / "eval.npz"
    save_sequences(train_path, seqs[:24])
    save_sequences(eval_path, seqs[24:])

    def eval_log(out: Path) -> list[dict[str, Any]]:
        return [json.loads(ln) for ln in (out / EVAL_LOG_FILE).read_text().splitlines()]

    full = _config(tmp_path / "full", train_path, model=str(small_dir), steps=6, lr=1e-2,
                   eval_sequences=(str(eval_path),), eval_every=2)
    train_eagle(full)
    a = eval_log(tmp_path / "full")
    assert [r["step"] for r in a] == [2, 4, 6]
    part = replace(full, out=str(tmp_path / "part"), stop_at_step=3)
    train_eagle(part)
    assert [r["step"] for r in eval_log(tmp_path / "part")] == [2, 3]
    resumed = replace(part, stop_at_step=0, resume=True)
    train_eagle(resumed)
    train_eagle(resumed)  # nothing left to train: the step-6 record is not written twice
    b = eval_log(tmp_path / "part")
    assert [r["step"] for r in b] == [2, 3, 4, 6]
    for ra, rb in zip(a, [b[0], *b[2:]], strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7), (ra, rb)
        assert ra["acc"] == rb["acc"]
    train_eagle(replace(full, out=str(tmp_path / "part"), eval_sequences=None, eval_every=0,
                        steps=1))
    assert not (tmp_path / "part" / EVAL_LOG_FILE).exists()


def test_ttt_forward_equals_inference_head(small_dir: Path) -> None:
    """Step k, row t of the training forward is the inference head's k-th chained draft
    after entry t (same modules, KV-pool attention): to fp32 rounding."""
    model, mcfg = load_model(str(small_dir), device=CPU, dtype=torch.float32)
    aux = default_aux_layers(mcfg.num_hidden_layers)
    cfg = TrainEagleConfig(out="unused", seed=3)
    head = build_head(cfg, model, mcfg, aux, None, CPU).eval()
    with torch.no_grad():  # non-trivial norms
        for n, p in head.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    n, steps = 10, 3
    ids = torch.tensor([[5, 17, 3, 44, 9, 60, 61, 62, 2, 90]])
    feats = TargetFeatureExtractor(model, mcfg, aux, max_batch_tokens=64, device=CPU,
                                   dtype=torch.float32)(ids)
    ttt = TTTForward(head, model.embed_tokens, model.lm_head.weight, steps)
    keys: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    outs = []
    with torch.no_grad():
        h = head.fc(feats.aux_hidden)
        embeds = model.embed_tokens(ids)
        pos = torch.arange(n).unsqueeze(0)
        for k in range(steps):
            shifted = torch.cat((embeds[:, 1 + k:], torch.zeros_like(embeds[:, :1 + k])), 1)
            h = ttt.layer_step(shifted, h, pos + k, keys, vals, ttt._mask(n, CPU))
            outs.append(h)
    lc = head.config.layer
    pool = KVPool(num_layers=1, num_pages=8, page_size=16, num_kv_heads=lc.num_key_value_heads,
                  head_dim=lc.head_dim, dtype=torch.float32, device=CPU)
    stored = head.fc(feats.aux_hidden)[0]
    for t in range(n - steps):
        entries = t + 1  # committed entries 0..t: token x_{p+1}, feature f_p, position p
        slots = torch.arange(16, 16 + entries + steps)
        with torch.no_grad():
            fb = ForwardBatch(ids[:, 1:entries + 1], torch.arange(entries).unsqueeze(0),
                              slots[:entries].unsqueeze(0), slots[:entries].unsqueeze(0),
                              torch.ones(entries, entries).tril().bool().unsqueeze(0))
            e = model.embed_tokens(fb.input_ids)
            cur = head(fb, pool, e, stored[:entries].unsqueeze(0))[:, -1:]
            torch.testing.assert_close(cur[0, 0], outs[0][0, t], atol=1e-5, rtol=1e-5)
            for k in range(1, steps):  # chain: token x_{t+1+k}, position t+k
                kv = slots[:entries + k].unsqueeze(0)
                fb = ForwardBatch(ids[:, t + 1 + k:t + 2 + k], torch.tensor([[t + k]]),
                                  slots[entries + k - 1:entries + k].unsqueeze(0), kv,
                                  torch.ones(1, 1, entries + k, dtype=torch.bool))
                cur = head(fb, pool, model.embed_tokens(fb.input_ids), cur)
                torch.testing.assert_close(cur[0, 0], outs[k][0, t], atol=1e-5, rtol=1e-5)


def test_loss_falls_and_resume_continues_exactly(small_dir: Path, small_seqs: Path,
                                                 tmp_path: Path) -> None:
    """Training lowers the loss; a run stopped at step 4 and resumed repeats the
    uninterrupted run's steps (loss, agreement, final weights); reduced-vocabulary export."""
    full = _config(tmp_path / "full", small_seqs, model=str(small_dir), steps=16, lr=1e-2,
                   draft_vocab_size=48)
    assert train_eagle(full) == tmp_path / "full"
    a = _log(tmp_path / "full")
    assert [r["step"] for r in a] == list(range(1, 17))
    first = sum(r["loss"] for r in a[:3]) / 3
    last = sum(r["loss"] for r in a[-3:]) / 3
    assert last < 0.75 * first, (first, last)
    assert len(a[-1]["acc"]) == 3 and a[-1]["acc"][0] > a[0]["acc"][0]
    part = replace(full, out=str(tmp_path / "part"), stop_at_step=4, checkpoint_every=3)
    train_eagle(part)
    assert [r["step"] for r in _log(tmp_path / "part")] == [1, 2, 3, 4]
    train_eagle(replace(part, stop_at_step=0, resume=True))
    b = _log(tmp_path / "part")
    assert [r["step"] for r in b] == list(range(1, 17))
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6, abs=1e-7), (ra, rb)
        assert ra["acc"] == rb["acc"]
    wa = load_file(str(tmp_path / "full" / "model.safetensors"))
    wb = load_file(str(tmp_path / "part" / "model.safetensors"))
    assert wa.keys() == wb.keys() and {"lm_head.weight", "d2t", "t2d"} <= wa.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-6, rtol=1e-5)
    # reduced vocabulary: the most frequent response tokens, mapped back by d2t
    _, mcfg = load_model(str(small_dir), device=CPU, dtype=torch.float32)
    head = load_eagle_head(tmp_path / "full", mcfg, device=CPU, dtype=torch.float32)
    assert head.lm_head is not None and tuple(head.lm_head.weight.shape) == (48, 32)
    resp = [t for q in load_sequences(small_seqs) for t in q.token_ids[q.num_prompt_tokens:]]
    assert max(set(resp), key=resp.count) in set(head.d2t.tolist())
    assert torch.equal(wa["t2d"].nonzero().squeeze(1), head.d2t)
    cfg_json = json.loads((tmp_path / "full" / "config.json").read_text())
    assert cfg_json["draft_vocab_size"] == 48
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    with pytest.raises(ValueError, match="ttt_steps"):
        train_eagle(replace(part, resume=True, ttt_steps=2, stop_at_step=0))


def test_trained_head_drafts_losslessly(tiny_dir: Path, tiny_llm: Any, seq_file: Path,
                                        tmp_path: Path) -> None:
    """A head trained on the target's own outputs (shared lm_head, the default) loads as the
    ``eagle`` drafter and greedy fp32 output equals speculation off."""
    out = tmp_path / "head"
    train_eagle(_config(out, seq_file, model=str(tiny_dir), steps=2, batch_tokens=128,
                        max_seq_len=48, ttt_steps=2))
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "draft_vocab_size" not in cfg_json  # shares the target's lm_head
    names = set(load_file(str(out / "model.safetensors")))
    assert "midlayer.self_attn.q_proj.weight" in names and "lm_head.weight" not in names
    from structspec import LLM

    prompts = _prompts(6, seed=9)
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    ref = [o.token_ids for o in tiny_llm.generate(prompts, sp)]
    with LLM(str(tiny_dir), device="cpu", dtype="float32", kv_capacity_tokens=4096,
             max_batch_size=16, speculative_algorithm="eagle", draft_model=str(out),
             num_draft_tokens=6, speculative_depth=3, speculative_topk=2) as spec:
        head = spec.engine.drafter.head if hasattr(spec.engine, "drafter") else None
        outs = spec.generate(prompts, sp)
    assert [o.token_ids for o in outs] == ref
    if head is not None:
        assert head.lm_head is None


def test_export_roundtrip_and_specforge_names(small_dir: Path, tmp_path: Path) -> None:
    """Our export loads bit-exactly; a SpecForge-style checkpoint (``model.`` prefixes, its
    own embed_tokens, full-vocab lm_head) and a shared-lm_head one load the same way."""
    model, mcfg = load_model(str(small_dir), device=CPU, dtype=torch.float32)
    head = build_head(TrainEagleConfig(out="x", seed=1), model, mcfg, (1, 3, 4), None, CPU)
    export_eagle3_head(head, tmp_path / "ours", target=mcfg, dtype=torch.float32)
    loaded = load_eagle_head(tmp_path / "ours", mcfg, device=CPU, dtype=torch.float32)
    sa, sb = head.state_dict(), loaded.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # SpecForge layout: a full-vocab lm_head of its own, embeddings saved, "model." prefix
    sf = tmp_path / "specforge"
    sf.mkdir()
    tensors = load_file(str(tmp_path / "ours" / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(mcfg.vocab_size, 32)
    tensors["embed_tokens.weight"] = torch.randn(mcfg.vocab_size, 32)
    save_file({f"model.{k}" if k != "lm_head.weight" else k: v for k, v in tensors.items()},
              str(sf / "model.safetensors"))
    cfg = json.loads((tmp_path / "ours" / "config.json").read_text())
    cfg["draft_vocab_size"] = mcfg.vocab_size
    (sf / "config.json").write_text(json.dumps(cfg))
    h2 = load_eagle_head(sf, mcfg, device=CPU, dtype=torch.float32)
    assert h2.lm_head is not None and h2.config.draft_vocab_size == mcfg.vocab_size
    assert torch.equal(h2.fc.weight, head.fc.weight)
    # no lm_head.weight but a reduced draft_vocab_size: refused, naming the field
    cfg["draft_vocab_size"] = 100
    (tmp_path / "ours" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_vocab_size 100 but no lm_head.weight"):
        load_eagle_head(tmp_path / "ours", mcfg, device=CPU, dtype=torch.float32)


def test_init_from_an_exported_head(small_dir: Path, tmp_path: Path) -> None:
    """``init_from`` starts a run from an exported head's weights (not the seed's init); a head
    with other aux layers is refused naming the field; init_from with resume is refused."""
    model, mcfg = load_model(str(small_dir), device=CPU, dtype=torch.float32)
    src = build_head(TrainEagleConfig(out="x", seed=1), model, mcfg, (1, 3, 4), None, CPU)
    export_eagle3_head(src, tmp_path / "src", target=mcfg, dtype=torch.float32)
    cfg = TrainEagleConfig(out="x", seed=2, init_from=str(tmp_path / "src"))
    head = build_head(cfg, model, mcfg, (1, 3, 4), None, CPU)
    fresh = build_head(replace(cfg, init_from=""), model, mcfg, (1, 3, 4), None, CPU)
    assert not torch.equal(fresh.fc.weight, src.fc.weight)
    for k, v in src.state_dict().items():
        assert torch.equal(head.state_dict()[k], v), k
    with pytest.raises(ValueError, match="init_from: .* aux_hidden_layers"):
        build_head(cfg, model, mcfg, (0, 2, 4), None, CPU)
    with pytest.raises(ValueError, match="init_from"):
        replace(cfg, resume=True).validate()
    (tmp_path / "src" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="init_from: .*config.json"):
        build_head(cfg, model, mcfg, (1, 3, 4), None, CPU)
    (tmp_path / "src" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="init_from: .*safetensors"):
        build_head(cfg, model, mcfg, (1, 3, 4), None, CPU)


def test_bad_inputs_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from structspec.cli import main

    a_file = tmp_path / "f"
    a_file.write_text("x")
    empty = tmp_path / "empty.npz"
    empty.write_text("\n")
    bad = tmp_path / "bad.npz"
    np.savez(bad, token_ids=np.zeros(3, dtype=np.uint16))
    with pytest.raises(ValueError, match="out: .* not a directory"):
        train_eagle(_config(a_file, empty))
    with pytest.raises(ValueError, match="out: cannot create"):
        train_eagle(_config(a_file / "sub", empty))
    with pytest.raises(ValueError, match="sequences: .*empty.npz: not a training sequence file"):
        train_eagle(_config(tmp_path / "o1", empty))
    with pytest.raises(ValueError, match=r"sequences: .*bad.npz: not a training sequence file "
                                         r"\(missing arrays"):
        train_eagle(_config(tmp_path / "o2", bad))
    with pytest.raises(FileNotFoundError, match="sequences: .* not found"):
        train_eagle(_config(tmp_path / "o3", tmp_path / "missing.npz"))
    with pytest.raises(ValueError, match="ttt_steps=0"):
        train_eagle(_config(tmp_path / "o4", empty, ttt_steps=0))
    with pytest.raises(ValueError, match=r"sequences: .* is a directory or another non-file"):
        train_eagle(_config(tmp_path / "o7", tmp_path))
    with pytest.raises(ValueError, match="eval_every=3: there is nothing to evaluate"):
        train_eagle(_config(tmp_path / "o8", empty, eval_every=3))
    # stage 'all': refused before the data stage runs (no model is loaded, no folder made)
    every = dict(stage="all", sequences=None, num_sharegpt=0, num_extraction=0, num_schema=0)
    with pytest.raises(ValueError, match="num_sharegpt_held_out=2: held-out prompts are "
                                         "evaluation data"):
        train_eagle(_config(tmp_path / "o9", empty, num_sharegpt_held_out=2, **every))
    with pytest.raises(FileNotFoundError, match="eval_sequences: .*missing.npz' not found"):
        train_eagle(_config(tmp_path / "o9", empty, eval_sequences=(
            str(tmp_path / "missing.npz"),), **{**every, "num_sharegpt": 1}))
    with pytest.raises(ValueError, match="eval_sequences: .* is a directory"):
        train_eagle(_config(tmp_path / "o9", empty, eval_sequences=(str(tmp_path),),
                            **{**every, "num_sharegpt": 1}))
    assert not (tmp_path / "o9").exists()
    with pytest.raises(ValueError, match=r"num_sharegpt_held_out=2: .* a data stage of their "
                                         r"own.*\(got num_sharegpt=2000, num_extraction=500"):
        train_eagle(TrainEagleConfig(out=str(tmp_path / "o11"), stage="data",
                                     num_sharegpt_held_out=2))
    assert not (tmp_path / "o11").exists()
    assert main(["train-eagle", "--out", str(a_file), "--stage", "train"]) == 2
    assert "--out: out:" in capsys.readouterr().err
    assert main(["train-eagle", "--out", str(tmp_path / "o5"), "--sequences", str(empty),
                 "--stage", "train"]) == 2
    assert "--sequences: sequences:" in capsys.readouterr().err
    assert main(["train-eagle", "--out", str(tmp_path / "o6"), "--stage", "data",
                 "--data-time-limit", "-1"]) == 2
    assert "--data-time-limit: data_time_limit_s=-1.0" in capsys.readouterr().err
    assert main(["train-eagle", "--out", str(tmp_path / "o10"), "--stage", "all",
                 "--num-sharegpt-held-out", "4"]) == 2
    assert "--num-sharegpt-held-out: num_sharegpt_held_out=4" in capsys.readouterr().err


def test_several_sequences_files(tmp_path: Path) -> None:
    """--sequences takes several files (read in order); the config survives the JSON that a
    data rank is started with; a missing second file is named."""
    import argparse

    from structspec.training.cli_train import config_from_args
    from structspec.training.train_eagle import sequence_paths

    a, b = tmp_path / "a.npz", tmp_path / "b.npz"
    parser = argparse.ArgumentParser()
    add_train_eagle_parser(parser.add_subparsers(), argparse.HelpFormatter)
    args = parser.parse_args(["train-eagle", "--out", str(tmp_path), "--sequences", str(a),
                              str(b)])
    cfg = config_from_args(args)
    assert cfg.sequences == (str(a), str(b))
    assert TrainEagleConfig.from_json(cfg.to_json()) == cfg
    assert sequence_paths(cfg, tmp_path) == [a, b]
    assert sequence_paths(_config(tmp_path, a), tmp_path) == [a]
    assert sequence_paths(_config(tmp_path, a, sequences=None), tmp_path) == [
        tmp_path / "sequences.npz"]
    save_sequences(a, [TrainSequence((1, 2, 3, 4), 2, "test")])
    with pytest.raises(FileNotFoundError, match="sequences: .*b.npz.* not found"):
        train_eagle(_config(tmp_path / "o", a, sequences=(str(a), str(b))))
    with pytest.raises(ValueError, match=r"sequences=\(\): expected one or more"):
        _config(tmp_path, a, sequences=()).validate()


def test_resume_from_a_damaged_checkpoint_names_the_file(tmp_path: Path) -> None:
    """A truncated checkpoint, a file of another format and a dict without the trainer's keys
    give a ValueError naming ``--resume`` and the path (was torch.load's zip-reader error)."""
    from structspec.training.train_state import CHECKPOINT_KEYS, Checkpoint

    path = tmp_path / "checkpoint" / "train_state.pt"
    ckpt = Checkpoint(path)
    good = {k: torch.zeros(2) for k in CHECKPOINT_KEYS}
    ckpt.save(good)
    assert set(ckpt.load()) == set(CHECKPOINT_KEYS)
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match=rf"^--resume: {path}: not a readable train-eagle "
                                         r"checkpoint \("):
        ckpt.load()
    path.write_text("not a checkpoint")
    with pytest.raises(ValueError, match=r"^--resume: .*: not a readable"):
        ckpt.load()
    ckpt.save({"head": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"not a train-eagle checkpoint \(missing fingerprint, "):
        ckpt.load()
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match=r"missing fingerprint"):
        ckpt.load()
