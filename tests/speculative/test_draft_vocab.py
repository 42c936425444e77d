"""The draft vocabulary (structspec/speculative/draft_vocab.py): picking, the file, the reduced
projection against the full one, and the shipped head using it losslessly."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from structspec.layers.quant_linear import Fp16Linear
from structspec.speculative.draft_vocab import (
    DRAFT_VOCAB_FILE,
    ReducedLmHead,
    frequent_tokens,
    load_draft_vocab,
    main,
    save_draft_vocab,
)


def test_frequent_tokens_by_count_then_id() -> None:
    ids = np.array([5, 5, 5, 2, 2, 9, 9, 7])
    assert frequent_tokens(ids, vocab_size=10, size=3).tolist() == [2, 5, 9]  # 7 loses the tie
    assert frequent_tokens(ids, vocab_size=10, size=6).tolist() == [0, 1, 2, 5, 7, 9]
    with pytest.raises(ValueError, match="size=11"):
        frequent_tokens(ids, vocab_size=10, size=11)
    with pytest.raises(ValueError, match="outside"):
        frequent_tokens(np.array([10]), vocab_size=10, size=1)


def test_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    assert load_draft_vocab(tmp_path, 100) is None
    save_draft_vocab(tmp_path, np.array([1, 4, 9]), coverage=0.5)
    assert load_draft_vocab(tmp_path, 100).tolist() == [1, 4, 9]
    # each refusal names the file and what is wrong with it
    for bad, why in (('{"token_ids": [4, 1]}', r"token_ids\[1\] = 1 does not exceed"),
                     ('{"token_ids": [1, 4, 4]}', r"token_ids\[2\] = 4 does not exceed"),
                     ('{"token_ids": []}', "is empty"),
                     ('{"token_ids": [1, 100]}', r"token_ids\[1\] = 100 is outside"),
                     ('{"token_ids": [-3, 1]}', r"token_ids\[0\] = -3 is outside"),
                     ('{"ids": [1]}', "not a list of integers"), ("not json", "not valid JSON"),
                     ('{"token_ids": [1.5, 2.7]}', "not a list of integers"),
                     ('{"token_ids": [false, true]}', "not a list of integers"),
                     ('{"token_ids": [1, 1e30]}', "not a list of integers"),
                     ('{"token_ids": [1, 99999999999999999999999]}', "(?i)overflow"),
                     ("[1, 2]", "not a list of integers")):
        (tmp_path / DRAFT_VOCAB_FILE).write_text(bad)
        with pytest.raises(ValueError, match=DRAFT_VOCAB_FILE) as e:
            load_draft_vocab(tmp_path, 100)
        assert re.search(why, str(e.value)), (bad, str(e.value))


def test_cli_writes_the_most_frequent_response_tokens(tmp_path: Path) -> None:
    # two sequences: prompts [1, 1, 1] and [2, 2]; responses [3, 3, 4] and [4, 4, 5]
    np.savez(tmp_path / "seq.npz", token_ids=np.array([1, 1, 1, 3, 3, 4, 2, 2, 4, 4, 5]),
             offsets=np.array([0, 6, 11]), num_prompt=np.array([3, 2]))
    main(["--data", str(tmp_path / "seq.npz"), "--head", str(tmp_path), "--vocab-size", "8",
          "--size", "2"])
    assert load_draft_vocab(tmp_path, 8).tolist() == [3, 4]  # prompt tokens do not count


@pytest.mark.parametrize(("args", "named"), [
    (["--size", "0"], "--size 0"),
    (["--vocab-size", "3"], "--vocab-size"),  # the data's ids 3..5 are outside it
    (["--data", "missing.npz"], "--data"),
    (["--data", "other.npz"], "--data"),  # no token_ids in it
    (["--head", "no_such_dir"], "--head"),
])
def test_cli_names_a_bad_argument(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str], args: list[str],
                                  named: str) -> None:
    monkeypatch.chdir(tmp_path)
    np.savez("seq.npz", token_ids=np.array([1, 3, 4, 5]), offsets=np.array([0, 4]),
             num_prompt=np.array([1]))
    np.savez("other.npz", ids=np.array([1]))
    base = {"--data": "seq.npz", "--head": ".", "--vocab-size": "8", "--size": "2"}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    with pytest.raises(SystemExit) as exit_info:
        main([a for kv in base.items() for a in kv])
    assert exit_info.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / DRAFT_VOCAB_FILE).exists()


@pytest.mark.parametrize("packed", [False, True])
def test_reduced_projection_equals_the_full_one_on_its_rows(packed: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(300, 64)
    ids = torch.tensor([0, 7, 64, 299])
    x = torch.randn(3, 64)
    full = (Fp16Linear.from_float(weight)(x) if packed
            else nn.functional.linear(x, weight))
    got = ReducedLmHead(weight, ids, packed_fp16=packed)(x)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got, full[:, ids], rtol=1e-5, atol=1e-5)



def test_config_names_a_bad_draft_vocab() -> None:
    from structspec.config import EngineConfig, SpecConfig, resolve_engine_config

    cfg = EngineConfig(device="cpu", spec=SpecConfig(algorithm="eagle", draft_vocab="half",
                                                     draft_model="x"))
    with pytest.raises(ValueError, match="speculative_draft_vocab='half'"):
        resolve_engine_config(cfg)
