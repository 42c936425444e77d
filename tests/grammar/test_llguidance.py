"""The llguidance backend: tree walks against a sequential reference (JSON, regex, choice),
the tokenizer wiring (padded vocabulary, special tokens, the stop id), every grammar kind,
errors naming the field, and ``auto``'s choice per schema."""

from __future__ import annotations

import json
import random
from typing import Any

import llguidance
import pytest
import torch
import xgrammar as xgr

from structspec.constraints import (
    ChoiceConstraint,
    EbnfConstraint,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from structspec.grammar import (
    GrammarBackend,
    GrammarError,
    GrammarTree,
    build_grammar_vocab_mask,
)
from structspec.grammar.llg_backend import LlgBackend
from structspec.grammar.llg_matcher import LlgCompiled, LlgMatcher, decode_mask_row
from structspec.grammar.schema_rewrite import rewrite_schema
from structspec.grammar.select_backend import SelectingBackend

from .conftest import STOP_ID, fast_compile_names
from .test_tree_mask import PREFIX, SCHEMA, _paths, _sequential_row, _tree

SEP = (", ", ": ")

# (constraint, a valid output text) for the walk tests
CASES: list[tuple[GrammarConstraint, str]] = [
    (JsonSchemaConstraint(SCHEMA), '{"name": "Bob", "age": 42}'),
    (RegexConstraint(r"[A-Z][a-z]+( [a-z]+){2,6}\."), "Hello big bright world."),
    (ChoiceConstraint(("yes", "no", "yes please", "maybe not")), "yes please"),
]


def _random_tree(ids: list[int], rng: random.Random, n: int,
                 noise: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft tree over ``ids`` (node 0 = ids[0]): a chain of the true continuation with
    random wrong siblings and children (next_token, next_sibling, draft_tokens, ``[1, n]``)."""
    toks, parents = [ids[0]], [-1]
    pos = {0: 1}  # node -> index of its true next token in ids (if on the true chain)
    for i in range(1, n):
        p = rng.randrange(i)
        if p in pos and pos[p] < len(ids) and rng.random() < 0.6:
            toks.append(ids[pos[p]])
            pos[i] = pos[p] + 1
        else:
            toks.append(rng.choice(noise))
        parents.append(p)
    nt, ns = [-1] * n, [-1] * n
    for c in range(n - 1, 0, -1):  # children linked in index order
        p = parents[c]
        ns[c], nt[p] = nt[p], c
    as_t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    return as_t(nt), as_t(ns), as_t(toks)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_tree_walk_matches_sequential_reference(llg_backend: LlgBackend, hf_tokenizer: Any,
                                                case: int) -> None:
    """Every expanded node's row equals the mask of a fresh matcher fed the node's path; rows
    of rejected or terminating nodes are all ones; the walk leaves the state unchanged."""
    spec, text = CASES[case]
    compiled = llg_backend.compile(spec)
    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [STOP_ID]
    noise = hf_tokenizer.encode(' "x", 12} abc ,. yes no', add_special_tokens=False)
    rng = random.Random(case)
    vocab = llg_backend.vocab_size
    for trial in range(6):
        cut = rng.randrange(len(ids) - 1)
        prefix = ids[: cut + 1]
        m = llg_backend.create_matcher(compiled)
        assert m.accept_run(prefix) == len(prefix)
        nt, ns, dt = _random_tree(ids[cut:], rng, 10, noise)
        mask = build_grammar_vocab_mask([m], GrammarTree.from_host(nt, ns, dt),
                                        vocab_size=vocab, device="cpu", time_limit_s=10.0)
        assert mask is not None and mask.truncated_requests == []
        assert m.num_accepted == len(prefix) and not m.is_terminated()
        paths = _paths(nt[0].tolist(), ns[0].tolist(), dt[0].tolist())
        rejected = 0
        for node, path in paths.items():
            row = mask.bitmask_cpu[node]
            ref = _sequential_row(llg_backend, compiled, prefix, path, vocab)  # type: ignore[arg-type]
            if ref is None or (path and path[-1] == STOP_ID):
                assert bool((row == -1).all()), (trial, node)
                if ref is None and _sequential_row(llg_backend, compiled, prefix,  # type: ignore[arg-type]
                                                   path[:-1], vocab) is not None \
                        and STOP_ID not in path[:-1]:
                    rejected += 1
            elif STOP_ID not in path:
                assert torch.equal(row, ref), (trial, node, path)
        assert mask.rejected_by_grammar == [rejected]


def _recursive_walk(m: LlgMatcher, nt: list[int], ns: list[int], dt: list[int],
                    rows: torch.Tensor) -> list[str]:
    """The recursive walk of ``LlgMatcher.traverse_draft_tree`` written out (fill, consume
    an allowed non-stop child, recurse, ``rollback(1)``): the reference of its rows.
    Returns the filled nodes in order."""
    llg, words, order = m._llg, rows.numpy(), []  # noqa: SLF001 - the reference walk
    width_bytes = rows.shape[1] * 4

    def expand(node: int) -> None:
        llg.unsafe_compute_mask_ptr(rows[node].data_ptr(), width_bytes)
        order.append(str(node))
        child = nt[node]
        while child != -1:
            tok = dt[child]
            if 0 <= tok < 32 * words.shape[1] and tok != STOP_ID \
                    and (int(words[node, tok >> 5]) >> (tok & 31)) & 1:
                assert llg.consume_token(tok)
                expand(child)
                llg.rollback(1)
            child = ns[child]

    expand(0)
    return order


def _wide_tree(ids: list[int], rng: random.Random, n: int, noise: list[int],
               chain: bool = False) -> tuple[list[int], list[int], list[int]]:
    """Like :func:`_random_tree`, with stop tokens, padding (-1) and out-of-vocabulary ids
    among the noise, and nodes attached mostly near the root (wide trees, many backtracks);
    ``chain``: node ``i``'s parent is ``i - 1`` (the n-gram drafter's trees), and the chain
    may end early (the later nodes are unreachable padding)."""
    toks, parents, pos = [ids[0]], [-1], {0: 1}
    end = rng.randrange(1, n + 1) if chain else n
    for i in range(1, n):
        p = (i - 1 if i < end else -2) if chain else min(rng.randrange(i), rng.randrange(i))
        if p == -2:  # padding past the chain's end: linked nowhere
            toks.append(-1)
        elif p in pos and pos[p] < len(ids) and rng.random() < 0.85:
            toks.append(ids[pos[p]])
            pos[i] = pos[p] + 1
        else:
            toks.append(rng.choice(noise + [STOP_ID, -1, 10**6]))
        parents.append(max(p, -1))
    nt, ns = [-1] * n, [-1] * n
    for c in range(n - 1, 0, -1):
        if parents[c] >= 0:
            ns[c], nt[parents[c]] = nt[parents[c]], c
    return nt, ns, toks


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_walk_equals_recursive_reference(llg_backend: LlgBackend, hf_tokenizer: Any,
                                         case: int, chain: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The walk (for chains: llguidance's draft-token fill) fills exactly the rows of the
    recursive reference walk, bit for bit (unfilled rows untouched), on random trees and
    chains with stop tokens, padding and out-of-vocabulary ids, and leaves the matcher where
    it was (the next mask and a full accept of the rest are a fresh matcher's)."""
    calls: list[bool | None] = []
    real = LlgMatcher._walk_chain  # noqa: SLF001 - records which path each walk took

    def walk_chain(self: LlgMatcher, *args: Any) -> bool | None:
        calls.append(real(self, *args))
        return calls[-1]

    monkeypatch.setattr(LlgMatcher, "_walk_chain", walk_chain)
    spec, text = CASES[case]
    compiled = llg_backend.compile(spec)
    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [STOP_ID]
    noise = hf_tokenizer.encode(' "x", 12} abc ,. yes no big', add_special_tokens=False)
    rng = random.Random(100 + case)
    width = (llg_backend.vocab_size + 31) // 32
    for _ in range(40):
        cut = rng.randrange(len(ids) - 1)
        m = llg_backend.create_matcher(compiled)
        ref_m = llg_backend.create_matcher(compiled)
        assert m.accept_run(ids[: cut + 1]) == cut + 1 == ref_m.accept_run(ids[: cut + 1])
        n = rng.choice([2, 5, 8, 16])
        nt, ns, dt = _wide_tree(ids[cut:], rng, n, noise, chain)
        rows = torch.full((n, width), 7, dtype=torch.int32)  # 7: "never written"
        ref_rows = rows.clone()
        as_t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        assert m.traverse_draft_tree(as_t(nt), as_t(ns), as_t(dt), rows, 10.0)
        _recursive_walk(ref_m, nt, ns, dt, ref_rows)
        assert torch.equal(rows, ref_rows)
        assert m.num_accepted == cut + 1
        after, ref_after = torch.zeros(2, width, dtype=torch.int32).unbind(0)
        m.fill_bitmask(after[None], 0)
        ref_m.fill_bitmask(ref_after[None], 0)
        assert torch.equal(after, ref_after)
        assert m.accept_run(ids[cut + 1:]) == len(ids) - cut - 1
    if chain:
        assert calls == [True] * 40  # every chain went to llguidance in one call
    else:
        assert None in calls  # trees with branches: the Python walk


def test_chain_timeout_leaves_state_and_exact_root_row(llg_backend: LlgBackend,
                                                       hf_tokenizer: Any) -> None:
    """A chain past its time limit (checked after llguidance's call): reported timed out,
    the matcher where it was, row 0 exact and the other rows all ones."""
    compiled = llg_backend.compile(CASES[1][0])
    ids = hf_tokenizer.encode("Hello big bright world.", add_special_tokens=False)
    m = llg_backend.create_matcher(compiled)
    m.accept_run(ids[:1])
    n = len(ids)
    nt = torch.tensor([list(range(1, n)) + [-1]], dtype=torch.int64)
    ns = torch.full((1, n), -1, dtype=torch.int64)
    dt = torch.tensor([ids], dtype=torch.int64)
    mask = build_grammar_vocab_mask([m], GrammarTree.from_host(nt, ns, dt),
                                    vocab_size=llg_backend.vocab_size, device="cpu",
                                    time_limit_s=0.0)
    assert mask is not None and mask.truncated_requests == [0]
    assert m.num_accepted == 1 and m.accept_run(ids[1:]) == n - 1
    ref = _sequential_row(llg_backend, compiled, ids[:1], [],  # type: ignore[arg-type]
                          llg_backend.vocab_size)
    assert ref is not None and torch.equal(mask.bitmask_cpu[0], ref)
    assert bool((mask.bitmask_cpu[1:] == -1).all())


def test_hand_built_json_tree_counts(llg_backend: LlgBackend, hf_tokenizer: Any) -> None:
    """The hand-built tree of the xgrammar tree tests: rows equal the sequential reference."""
    compiled = llg_backend.compile(JsonSchemaConstraint(SCHEMA))
    prefix = hf_tokenizer.encode(PREFIX, add_special_tokens=False)
    m = llg_backend.create_matcher(compiled)
    assert m.accept_run(prefix) == len(prefix)
    nt, ns, dt = _tree(prefix[-1])
    mask = build_grammar_vocab_mask([m], GrammarTree.from_host(nt[None], ns[None], dt[None]),
                                    vocab_size=llg_backend.vocab_size, device="cpu",
                                    time_limit_s=10.0)
    assert mask is not None
    # '"' after the colon; "," after "4" is allowed here, unlike under xgrammar's strict mode:
    # SCHEMA leaves additionalProperties open and llguidance follows the schema (xgrammar's
    # strict_mode closes objects, a stricter grammar)
    assert mask.rejected_by_grammar == [1]
    for node, path in _paths(nt.tolist(), ns.tolist(), dt.tolist()).items():
        ref = _sequential_row(llg_backend, compiled, prefix, path,  # type: ignore[arg-type]
                              llg_backend.vocab_size)
        if ref is not None and STOP_ID not in path:
            assert torch.equal(mask.bitmask_cpu[node], ref), node


def test_timeout_leaves_state_and_exact_root_row(llg_backend: LlgBackend,
                                                 hf_tokenizer: Any) -> None:
    compiled = llg_backend.compile(CASES[1][0])
    ids = hf_tokenizer.encode("Hello big bright world.", add_special_tokens=False)
    m = llg_backend.create_matcher(compiled)
    m.accept_run(ids[:1])
    nt, ns, dt = _random_tree(ids, random.Random(0), 8, ids)
    mask = build_grammar_vocab_mask([m], GrammarTree.from_host(nt, ns, dt),
                                    vocab_size=llg_backend.vocab_size, device="cpu",
                                    time_limit_s=0.0)
    assert mask is not None and mask.truncated_requests == [0]
    assert mask.max_accept_cpu.tolist() == [0]
    assert m.num_accepted == 1
    ref = _sequential_row(llg_backend, compiled, ids[:1], [],  # type: ignore[arg-type]
                          llg_backend.vocab_size)
    assert ref is not None and torch.equal(mask.bitmask_cpu[0], ref)
    assert bool((mask.bitmask_cpu[1:] == -1).all())


def test_tokenizer_wiring(llg_backend: LlgBackend, backend: GrammarBackend,
                          hf_tokenizer: Any) -> None:
    """Padded ids past the tokenizer and special tokens are never allowed; the stop id only
    where the grammar may end, and accepting it terminates; rows have xgrammar's width."""
    vocab = llg_backend.vocab_size
    assert vocab == len(hf_tokenizer) + 64 == backend.vocab_size
    compiled = llg_backend.compile(JsonObjectConstraint())
    m = llg_backend.create_matcher(compiled)
    row = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    assert m.fill_bitmask(row, 0)
    allowed = set(decode_mask_row(row[0], vocab))
    assert allowed and max(allowed) < len(hf_tokenizer)
    specials = set(hf_tokenizer.all_special_ids)
    assert not allowed & specials
    ids = hf_tokenizer.encode('{"a": 1}', add_special_tokens=False)
    assert not m.accept_token(STOP_ID)  # not complete yet: refused, state unchanged
    assert m.accept_run(ids) == len(ids) and m.is_completed() and not m.is_terminated()
    m.fill_bitmask(row, 0)
    assert STOP_ID in decode_mask_row(row[0], vocab)
    assert m.accept_run([STOP_ID, ids[0]]) == 1 and m.is_terminated()
    assert not m.accept_token(ids[0]) and m.accept_run(ids) == 0
    m.rollback(1)  # undo the stop token
    assert not m.is_terminated() and m.num_accepted == len(ids)
    with pytest.raises(ValueError, match="roll back"):
        m.rollback(len(ids) + 1)
    # the same text with xgrammar's json_object: the same verdicts
    x = backend.create_matcher(backend.compile(JsonObjectConstraint()))
    assert x.accept_run(ids + [STOP_ID]) == len(ids) + 1 and x.is_terminated()


def test_every_kind_compiles_and_accepts(llg_backend: LlgBackend, hf_tokenizer: Any) -> None:
    gbnf = 'root ::= "Answer: " ("yes" | "no") " because " [a-z ]+ "."'
    for spec, text in [*CASES, (EbnfConstraint(gbnf), "Answer: no because it rains."),
                       (JsonObjectConstraint(), '{"k": [1, 2, {"x": null}]}')]:
        compiled = llg_backend.compile(spec)
        assert isinstance(compiled, LlgCompiled) and compiled.kind == spec.kind
        m = llg_backend.create_matcher(compiled)
        ids = hf_tokenizer.encode(text, add_special_tokens=False) + [STOP_ID]
        assert m.accept_run(ids) == len(ids) and m.is_terminated(), spec.kind
    forced = llg_backend.create_matcher(llg_backend.compile(ChoiceConstraint(("only one",))))
    forced_text = hf_tokenizer.decode(forced.forced_tokens())
    assert forced_text and "only one".startswith(forced_text)


@pytest.mark.parametrize(("spec", "param", "words"), [
    (RegexConstraint("(a"), "regex", "unclosed group"),
    (JsonSchemaConstraint({"type": "objectz"}), "json_schema", "objectz"),
    (JsonSchemaConstraint({"type": "object", "properties": {"a": {"not": {"const": "x"}}}}),
     "json_schema", "not"),
    (EbnfConstraint('root ::= "a" undefined_rule'), "ebnf", "undefined_rule"),
    (ChoiceConstraint(()), "choice", "non-empty"),
    (JsonSchemaConstraint('{"type": '), "json_schema", "not valid JSON"),
])
def test_errors_name_the_field(llg_backend: LlgBackend, spec: GrammarConstraint, param: str,
                               words: str) -> None:
    with pytest.raises(GrammarError) as info:
        llg_backend.compile(spec, timeout=60)
    assert info.value.param == param
    assert words.lower() in str(info.value).lower()


GBNF_SYNTAX_ERRORS = [
    # (grammar, llguidance's reason and where, the line shown with its number, caret indent)
    ('root ::= "a" (\n', "Expected ')' at line 2, column 1 (at the end of the grammar)",
     'line 1: root ::= "a" (', 14),
    ('root ::= "a"\nb ::= "x" ]\n', "Expected name at line 2, column 11",
     'line 2: b ::= "x" ]', 10),
    # the column counts characters (llguidance's offset and xgrammar's column are UTF-8
    # bytes: column 15 there), and the caret goes under the character
    ('root ::= "\u00e9" ) "x"', "Expected name at line 1, column 14",
     'line 1: root ::= "\u00e9" ) "x"', 13),
]


@pytest.mark.parametrize("grammar,reason,shown,indent", GBNF_SYNTAX_ERRORS)
def test_gbnf_syntax_error_names_line_column_and_shows_a_caret(
        llg_backend: LlgBackend, grammar: str, reason: str, shown: str, indent: int) -> None:
    """llguidance's GBNF reader said only ``at line 2, 'root ::= "a" (\\n' ^ ''`` (the line
    and 20 characters either side); now the line and column and the grammar line with a
    caret, as the xgrammar path shows them, in the command line's check and the compile."""
    from structspec.grammar.llg_compile import check_grammar_llguidance

    spec = EbnfConstraint(grammar)
    caret = " " * (len("  line 1: ") + indent) + "^"
    for refuse in (lambda: check_grammar_llguidance(spec),
                   lambda: llg_backend.compile(spec, timeout=60)):
        with pytest.raises(GrammarError) as info:
            refuse()
        message = str(info.value)
        assert message.startswith("Failed to compile ebnf grammar (llguidance): "), message
        assert message.endswith(f"{reason}\n  {shown}\n{caret}"), message
        assert info.value.param == "ebnf"


@pytest.mark.parametrize("spec,reason", [
    (EbnfConstraint('root ::= "a"{3,1}\n'), "range end must be >= start, got (3, 1)"),
    (RegexConstraint("a{3,1}"), 'invalid regex "a{3,1}"'),
])
def test_position_in_llguidances_lark_translation_is_dropped(
        llg_backend: LlgBackend, spec: GrammarConstraint, reason: str) -> None:
    """An error llguidance finds after translating to Lark was positioned in the translation
    (``at 3(8):``, line 3 of a one-line grammar); that position is dropped, as the xgrammar
    path drops its own internal position of a regex."""
    from structspec.grammar.llg_compile import check_grammar_llguidance

    for refuse in (lambda: check_grammar_llguidance(spec),
                   lambda: llg_backend.compile(spec, timeout=60)):
        with pytest.raises(GrammarError) as info:
            refuse()
        assert str(info.value).startswith(
            f"Failed to compile {spec.kind} grammar (llguidance): {reason}"), str(info.value)


def test_unimplemented_keywords_are_named_with_their_pointers(llg_backend: LlgBackend) -> None:
    """llguidance names a keyword it does not implement but not where it is; the refusal adds
    its JSON pointers in the client's schema (property names that look like keywords are not
    counted), at most five of them."""
    from structspec.grammar.llg_compile import check_grammar_llguidance

    schema = {"type": "object", "properties": {
        "uniqueItems": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
        "more": {"$ref": "#/$defs/list"}},
        "$defs": {"list": {"type": "array", "uniqueItems": True}}}
    spec = JsonSchemaConstraint(schema)
    for refuse in (lambda: check_grammar_llguidance(spec),
                   lambda: llg_backend.compile(spec, timeout=60)):
        with pytest.raises(GrammarError) as info:
            refuse()
        assert str(info.value).endswith(
            'Unimplemented keys: ["uniqueItems"] (at /properties/uniqueItems/uniqueItems, '
            "/$defs/list/uniqueItems)"), str(info.value)
        assert info.value.param == "json_schema"
    many = {"type": "object", "properties": {
        f"p{i}": {"type": "array", "uniqueItems": True} for i in range(7)}}
    with pytest.raises(GrammarError, match=r"/properties/p4/uniqueItems and 2 more\)$"):
        check_grammar_llguidance(JsonSchemaConstraint(many))


def test_gbnf_error_without_a_position_is_left_as_llguidance_wrote_it() -> None:
    from structspec.grammar.llg_compile import check_grammar_llguidance

    with pytest.raises(GrammarError) as info:
        check_grammar_llguidance(EbnfConstraint('root ::= "a" c\n'))
    assert str(info.value) == ("Failed to compile ebnf grammar (llguidance): Failed to convert "
                               "the grammar from GBNF to Lark: Rule 'c' not found")


def _auto_cases(maskbench: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict]]:
    """MaskBench schemas xgrammar's strict check refuses (fast ones), in name order."""
    from structspec.grammar import find_unenforceable

    fast = fast_compile_names()
    # the schemas xgrammar's strict check refuses after the exact rewrites (the engine's
    # order: rewrite, then check)
    return [(n, c) for n, c in maskbench
            if n in fast and find_unenforceable(rewrite_schema(c["schema"])[0])]


def test_auto_picks_llguidance_when_xgrammar_strict_refuses(
        backend: GrammarBackend, llg_backend: LlgBackend, hf_tokenizer: Any,
        maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    """``auto``: xgrammar for a schema its strict check passes; llguidance for MaskBench
    schemas it refuses but llguidance compiles exactly (their valid instances are accepted);
    xgrammar's error, naming the keyword's JSON pointer, when both refuse."""
    auto = SelectingBackend("auto", xgrammar=backend, llguidance=llg_backend)
    assert isinstance(auto.compile(JsonSchemaConstraint(SCHEMA), timeout=60),
                      xgr.CompiledGrammar)
    picked = refused = 0
    for name, case in _auto_cases(maskbench)[:12]:
        try:
            compiled = auto.compile(JsonSchemaConstraint(case["schema"]), timeout=60)
        except GrammarError as e:
            assert "cannot be enforced exactly" in str(e) and ": " in str(e), name
            refused += 1
            continue
        assert isinstance(compiled, LlgCompiled), name
        picked += 1
        m = auto.create_matcher(compiled)
        assert isinstance(m, LlgMatcher) and m.backend == "llguidance"
    assert picked >= 1, (picked, refused)
    both = JsonSchemaConstraint({"type": "object", "properties": {
        "a": {"type": "string", "not": {"const": "x"}}}, "required": ["a"]})
    with pytest.raises(GrammarError) as info:
        auto.compile(both, timeout=60)
    assert "/properties/a" in str(info.value) and "not" in str(info.value)
    assert info.value.param == "json_schema"


def test_valid_instances_same_as_bare_llguidance(
        llg_backend: LlgBackend, hf_tokenizer: Any,
        maskbench: list[tuple[str, dict[str, Any]]]) -> None:
    """Our matcher accepts exactly what a bare ``llguidance.LLMatcher`` accepts on MaskBench
    valid instances (a fast subset), with the engine's separators."""
    fast = sorted(fast_compile_names())[:60]
    cases = [(n, c) for n, c in maskbench if n in fast]
    total = accepted = 0
    for name, case in cases:
        try:
            compiled = llg_backend.compile(JsonSchemaConstraint(case["schema"]), timeout=60)
        except GrammarError:
            continue
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            case["schema"], overrides={"whitespace_flexible": False, "item_separator": SEP[0],
                                       "key_separator": SEP[1]})
        for t in case["tests"]:
            if not t["valid"]:
                continue
            ids = hf_tokenizer.encode(json.dumps(t["data"], separators=SEP),
                                      add_special_tokens=False) + [STOP_ID]
            m = llg_backend.create_matcher(compiled)
            ours = m.accept_run(ids) == len(ids) and m.is_terminated()
            bare = llguidance.LLMatcher(llg_backend.tokenizer, grammar, log_level=0)
            theirs = bare.consume_tokens(ids) and bare.is_stopped() and not bare.is_error()
            assert ours == theirs, (name, t["description"])
            total += 1
            accepted += ours
    print(f"\nllguidance: {accepted}/{total} valid instances accepted")
    assert total >= 50 and accepted / total > 0.75, (accepted, total)


def test_auto_falls_back_when_xgrammar_runs_out_of_time(llg_backend: LlgBackend) -> None:
    """An xgrammar compile past its time limit hands the grammar to llguidance (its own time
    limit); the request is served, not refused."""
    import time

    from structspec.grammar.backend import GrammarFuture, _Entry
    from structspec.grammar.select_backend import AutoFuture

    spec = RegexConstraint(r"[a-z]{3}")
    stuck = GrammarFuture(_Entry(), timeout_s=0.01, submitted_at=time.perf_counter(),
                          kind=spec.kind)  # never finishes: expires after 10 ms
    fut = AutoFuture(spec.kind, stuck, llg_backend, spec)
    assert isinstance(fut.result(timeout=30), LlgCompiled)
    assert fut.done() and not fut.expired(time.perf_counter())


def test_auto_after_an_xgrammar_time_out_reports_llguidance_refusal(
        llg_backend: LlgBackend) -> None:
    """xgrammar past its time limit, then llguidance refuses: the error is llguidance's
    reason (naming the field), not xgrammar's "still running after the 0 s wait"."""
    import time

    from structspec.grammar.backend import GrammarFuture, _Entry
    from structspec.grammar.errors import GrammarError
    from structspec.grammar.select_backend import AutoFuture

    spec = JsonSchemaConstraint({"type": "object", "not": {"pattern": "a"}})
    stuck = GrammarFuture(_Entry(), timeout_s=0.01, submitted_at=time.perf_counter(),
                          kind=spec.kind)
    fut = AutoFuture(spec.kind, stuck, llg_backend, spec)
    with pytest.raises(GrammarError, match="not.*xgrammar: ran out of its compile time") as e:
        fut.result(timeout=30)
    assert e.value.param is not None and "still running" not in str(e.value)


def test_auto_time_out_note_follows_llguidances_caret_block(llg_backend: LlgBackend) -> None:
    """xgrammar past its time limit, then llguidance refuses an EBNF grammar with a caret
    block: the note about xgrammar follows on a line of its own (it used to close a
    parenthesis at the end of the caret line)."""
    import time

    from structspec.grammar.backend import GrammarFuture, _Entry
    from structspec.grammar.select_backend import AutoFuture

    spec = EbnfConstraint('root ::= "a"\nb ::= "x" ]\n')
    stuck = GrammarFuture(_Entry(), timeout_s=0.01, submitted_at=time.perf_counter(),
                          kind=spec.kind)
    with pytest.raises(GrammarError) as e:
        AutoFuture(spec.kind, stuck, llg_backend, spec).result(timeout=30)
    assert str(e.value).endswith('  line 2: b ::= "x" ]\n                    ^\n'
                                 "xgrammar: ran out of its compile time"), str(e.value)
