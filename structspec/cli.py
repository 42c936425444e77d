"""``structspec generate`` (offline structured generation), ``structspec serve`` (HTTP) and
``structspec train-eagle`` (EAGLE-3 head training, :mod:`structspec.training.cli_train`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from structspec import constraint_parse as cp
from structspec.chat_template import load_chat_template
from structspec.cli_argv import join_negative_values
from structspec.cli_output import print_batch, print_one
from structspec.cli_version import VersionAction
from structspec.constraints import (
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    StructuralTagConstraint,
)
from structspec.core import (
    ChatMessageError,
    RequestOutput,
    SamplingParams,
    check_chat_messages,
    request_error_code,
)
from structspec.draft_flags import check_model_and_draft_flags
from structspec.engine_args import (
    add_engine_args,
    engine_kwargs,
    flag_error,
    int_range,
    unused_speculative_flags,
)
from structspec.penalty_params import (
    RepetitionStop,
    logit_bias_from_json,
    out_of_vocab,
    repetition_stop_from_json,
)
from structspec.training.cli_train import add_train_eagle_parser, cmd_train_eagle
from structspec.write_probe import probe_file_writable

#: a line opening a Lark rule (``start: "a" | "b"``, ``?value: ...``) or an ``%import``
_LARK_RULE = re.compile(r"^\s*(?:[?!]?[A-Za-z_]\w*\s*:(?![:/\\])|%import\s)", re.MULTILINE)


def build_parser() -> argparse.ArgumentParser:
    """The ``structspec`` argument parser (every flag has a help line)."""
    parser = argparse.ArgumentParser(
        prog="structspec",
        description="Structured generation with speculative decoding.",
    )
    parser.add_argument("--version", action=VersionAction,
                        help="print the structspec, torch and Python versions and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline, optionally under a grammar",
                         description="Generate text for one prompt or a JSONL batch. Exit "
                                     "status: 0 ok, 1 a request failed (its error is printed), "
                                     "2 bad command line.",
                         formatter_class=_DefaultsHelpFormatter)
    add_engine_args(gen)
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text, sent as one user message via the chat "
                                      "template (see --raw-prompt)")
    src.add_argument("--messages", help="JSON file with a list of {role, content} messages")
    src.add_argument("--batch", help="JSONL file: one request per line with 'prompt' or "
                                     "'messages' and optional per-request fields (at most "
                                     "one of json_schema, regex, ebnf, choice, json_object, "
                                     "structural_tag; "
                                     "strict, bounded_numbers, max_tokens, min_tokens, "
                                     "temperature, seed, "
                                     "stop, include_stop_str_in_output, "
                                     "skip_special_tokens, top_p, top_k, min_p, "
                                     "presence_penalty, frequency_penalty, "
                                     "repetition_penalty, logit_bias, repetition_stop); a "
                                     "line with other keys fails alone")
    gen.add_argument("--raw-prompt", action="store_true",
                     help="send --prompt as is, without the chat template")
    gram = gen.add_mutually_exclusive_group()
    gram.add_argument("--json-schema", help="JSON Schema: a file path or inline JSON")
    gram.add_argument("--json-object", action="store_true", help="any JSON object")
    gram.add_argument("--regex", help="output must fully match this regular expression")
    gram.add_argument("--ebnf", help="GBNF grammar (start symbol 'root'): a file path, or "
                                     "the grammar itself when no such file exists "
                                     "(inline text has a 'name ::= ...' rule)")
    gram.add_argument("--choice", nargs="+", help="output is exactly one of these strings")
    gram.add_argument("--structural-tag",
                      help="xgrammar structural tag (free text; after a trigger, the tagged "
                           "section): a file path or inline JSON, {\"type\": "
                           "\"structural_tag\", \"format\": ...} or the legacy "
                           "{\"structures\": ..., \"triggers\": ...}")
    gen.add_argument("--no-strict", action="store_true",
                     help="JSON Schema best effort (--json-schema, and the schemas of "
                          "--structural-tag): allow keywords the grammar cannot enforce "
                          "(--json-schema: report schema_valid afterwards)")
    gen.add_argument("--unbounded-numbers", action="store_true",
                     help="JSON grammars without the default number bounds (a loop guard: "
                          "integers within +-10**18, numbers within +-10**15, at most 6 "
                          "fraction digits, unless the schema sets its own bounds)")
    gen.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="no stop token or stop string ends an answer before this many "
                          "tokens (a grammar whose structure is complete still ends it)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 disables")
    gen.add_argument("--request-seed", dest="request_seed", type=int, default=None,
                     help="per-request sampling seed, 0 to 2**63 - 1 (with float32 weights "
                          "the same output in any batch, with any drafter or none, at any tree "
                          "size; int4/bf16 logits shift with the batch's shape)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--include-stop-str-in-output", action="store_true",
                     help="keep the stop string that ended the answer in its text (and the "
                          "text of the stop token that ended it: EOS with "
                          "--no-skip-special-tokens)")
    gen.add_argument("--no-skip-special-tokens", dest="skip_special_tokens",
                     action="store_false",
                     help="keep special tokens (e.g. <|im_end|>) in the text")
    pen = gen.add_argument_group("penalties and loop guards")
    pen.add_argument("--presence-penalty", type=float, default=0.0,
                     help="OpenAI presence penalty in [-2, 2] over the output's tokens")
    pen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="OpenAI frequency penalty in [-2, 2] over the output's tokens")
    pen.add_argument("--repetition-penalty", type=float, default=1.0,
                     help="vLLM/HF repetition penalty in [0.01, 100] over prompt and output "
                          "tokens (> 1 discourages repeats)")
    pen.add_argument("--logit-bias", default=None,
                     help='JSON object {"token_id": bias in [-100, 100]}, inline or a file')
    pen.add_argument("--stop-on-repeat", type=int, nargs="?", const=RepetitionStop.min_tokens,
                     default=None, metavar="MIN_TOKENS",
                     help="end a request whose output ends in a loop (one unit of up to "
                          f"{RepetitionStop.max_period} tokens repeated at least "
                          f"{RepetitionStop.min_repeats} times over at least MIN_TOKENS "
                          f"tokens, default {RepetitionStop.min_tokens}): finish_reason "
                          "length, stop_reason repetition")
    gen.add_argument("--output", choices=["text", "json"], default=None,
                     help="text: only the completion (with --batch: each under a '### line "
                          "N' header); json: one record per request. An answer cut at "
                          "finish_reason length gets a one-line notice on stderr in text "
                          "mode. Default: text, json with --batch")
    gen.add_argument("--out-file", default=None,
                     help="--batch only: write the results here (default: stdout); a JSONL "
                          "record has the 'line' of its input line")

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                         description="Serve the OpenAI API (chat/completions, structured "
                                     "outputs, streaming).",
                         formatter_class=_DefaultsHelpFormatter)
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="bind address")
    srv.add_argument("--port", type=int_range(0, 65535), default=8000,
                     help="TCP port (0: any free port)")
    srv.add_argument("--api-key", default=os.environ.get("STRUCTSPEC_API_KEY"),
                     help="require 'Authorization: Bearer KEY' (env STRUCTSPEC_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="model id in the API")
    srv.add_argument("--tool-call-parser", choices=("hermes",), default=None,
                     help="read tool_choice 'auto' answers as tool calls in this format "
                          "(hermes: <tool_call>{\"name\", \"arguments\"}</tool_call>, the "
                          "arguments generated under the tool's schema by a structural tag); "
                          "default: plain text")
    # the server's own options (light modules: no fastapi, no torch)
    from structspec.server.limits import add_limit_args
    from structspec.server.log_config import add_log_args
    from structspec.server.supervisor import add_supervision_args

    add_limit_args(srv)
    add_supervision_args(srv)
    add_log_args(srv)
    add_train_eagle_parser(sub, _DefaultsHelpFormatter)
    return parser


def _read_text_arg(value: str, name: str) -> str:
    """The text of a flag that takes a file path or the text itself (``--ebnf``,
    ``--json-schema``, ``--logit-bias``): the file's contents, decoded as UTF-8 (a leading
    UTF-8 BOM, as editors on Windows write one, dropped), when ``value`` names a file, else
    ``value`` itself (the very object: callers test ``is``).

    Raises:
        ValueError: naming ``name`` and the path: a directory, a file that cannot be read, or
            one that is not UTF-8 (the first bad byte, its offset, line and column;
            :func:`_utf8_error_at`).
    """
    if len(value) >= 4096:  # inline text (too long for a path)
        return value
    path = Path(value)
    try:
        is_dir, is_file = path.is_dir(), path.is_file()
    except OSError:  # a path part over the file system's name limit: inline text
        return value
    if is_dir:
        raise ValueError(f"{name}: {value!r} is a directory, not a file")
    if not is_file:
        return value
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"{name}: cannot read {value!r}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: {value!r} is not UTF-8: {_utf8_error_at(data, e)}") from None


def _utf8_error_at(data: bytes, e: UnicodeDecodeError) -> str:
    """Where ``data`` stops being UTF-8, for a person: ``byte 0xff at offset 12 (line 2,
    column 5) cannot start a character`` (offset 0-based in bytes; line and column 1-based,
    the column counted in characters, as an editor shows it)."""
    start = e.start
    line_start = data.rfind(b"\n", 0, start) + 1
    line = data.count(b"\n", 0, start) + 1
    # everything before ``start`` decoded: the first bad byte is at ``start``
    column = len(data[line_start:start].decode("utf-8")) + 1
    why = _UTF8_REASONS.get(e.reason, e.reason)
    return f"byte 0x{data[start]:02x} at offset {start} (line {line}, column {column}) {why}"


def _utf8_error_in_line(raw: bytes, e: UnicodeDecodeError) -> str:
    """Where one line's bytes stop being UTF-8: ``byte 0xff at column 5 cannot start a
    character`` (the column 1-based, in characters; a UTF-8 BOM before it is not counted)."""
    start = e.start
    column = len(raw[:start].decode("utf-8").removeprefix("\ufeff")) + 1
    why = _UTF8_REASONS.get(e.reason, e.reason)
    return f"byte 0x{raw[start]:02x} at column {column} {why}"


_UTF8_REASONS = {
    "invalid start byte": "cannot start a character",
    "invalid continuation byte": "starts a character the next byte does not continue",
    "unexpected end of data": "starts a character the file ends inside",
}
"""Python's :class:`UnicodeDecodeError` reasons, said of the first bad byte."""


def grammar_from_args(args: argparse.Namespace) -> GrammarConstraint | None:
    """The grammar selected by CLI flags (``--json-schema``, ``--regex``, ...).

    The flags' files are read here; every value is checked and built by
    :mod:`structspec.constraint_parse` (:data:`~structspec.constraint_parse.FLAG_STYLE`).
    A flag given with an empty value (``--regex ""``, an empty ``--ebnf`` file) is refused:
    tested for truthiness, it used to drop the constraint and run unconstrained.

    Raises:
        ValueError: an empty value, unreadable file or schema that is not JSON, naming the
            flag.
    """
    if args.no_strict and args.json_schema is None and args.structural_tag is None:
        # strictness is a JSON Schema option; with another grammar (or none) the flag would be
        # ignored silently (--batch records carry their own "strict")
        raise ValueError("--no-strict: applies to --json-schema and --structural-tag only")
    grammar = _flag_grammar(args)
    if args.unbounded_numbers and (grammar is not None or not args.batch):
        # with --batch and no grammar flag it applies to the lines' JSON grammars
        grammar = cp.without_number_bounds(grammar, "--unbounded-numbers")
    return grammar


def _flag_grammar(args: argparse.Namespace) -> GrammarConstraint | None:
    """The grammar of the grammar flags (see :func:`grammar_from_args`)."""
    if args.json_schema is not None:
        if not args.json_schema.strip():
            raise ValueError("--json-schema: empty schema")
        text = _read_text_arg(args.json_schema, "--json-schema")
        if not text.strip():
            raise ValueError(f"--json-schema: empty schema file {args.json_schema!r}")
        if text is not args.json_schema:  # a file: a JSON error is the file's, not a path's
            try:
                json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--json-schema: {args.json_schema!r} is not valid JSON: "
                                 f"{e}") from None
        if text is args.json_schema and text.strip()[:1] not in ("{", "[", "t", "f") and (
                text.endswith(".json") or "/" in text):
            raise ValueError(f"--json-schema: no such file {text!r}")
        return cp.json_schema_constraint(text, "--json-schema", cp.FLAG_STYLE,
                                         strict=not args.no_strict)
    if args.json_object:
        return JsonObjectConstraint()
    if args.regex is not None:
        return cp.regex_constraint(args.regex, "--regex", cp.FLAG_STYLE)
    if args.ebnf is not None:
        if not args.ebnf.strip():
            raise ValueError("--ebnf: empty grammar")
        text = _read_text_arg(args.ebnf, "--ebnf")
        if text is args.ebnf and "::=" not in text:
            # neither a file nor a grammar (every GBNF grammar has a rule): a mistyped path,
            # or a Lark grammar ("start: ..."), which no grammar kind here reads
            lark = _LARK_RULE.search(text) is not None
            raise ValueError(f"--ebnf: no such file {args.ebnf!r} (and not an inline grammar: "
                             "no 'name ::= ...' rule" + ("; Lark rules ('name: ...') are not "
                             "read: write them as GBNF, 'name ::= ...'" if lark else "") + ")")
        source = "" if text is args.ebnf else args.ebnf
        return cp.ebnf_constraint(text, "--ebnf", cp.FLAG_STYLE, source=source)
    if args.choice is not None:
        return cp.choice_constraint(args.choice, "--choice", cp.FLAG_STYLE)
    if args.structural_tag is not None:
        return _structural_tag_flag(args.structural_tag, strict=not args.no_strict)
    return None


def _structural_tag_flag(value: str, *, strict: bool) -> StructuralTagConstraint:
    """``--structural-tag``: a file's text or inline JSON, checked as the server checks a tag
    (a problem inside it names its place: ``--structural-tag.structures[0].schema``).

    Raises:
        ValueError: an empty value or file, a path that names no file, text that is not JSON,
            or a tag the reader refuses.
    """
    if not value.strip():
        raise ValueError("--structural-tag: empty structural tag")
    text = _read_text_arg(value, "--structural-tag")
    if not text.strip():
        raise ValueError(f"--structural-tag: empty structural tag file {value!r}")
    try:
        tag = json.loads(text)
    except json.JSONDecodeError as e:
        if text is value and text.strip()[:1] not in ("{", "[", '"'):
            raise ValueError(f"--structural-tag: no such file {value!r} (and not inline "
                             "JSON)") from None
        where = "inline JSON" if text is value else repr(value)
        raise ValueError(f"--structural-tag: {where} is not valid JSON: {e}") from None
    return cp.structural_tag_constraint(tag, "--structural-tag", cp.FLAG_STYLE, strict=strict)


def _precheck_grammar(args: argparse.Namespace, grammar: GrammarConstraint | None) -> None:
    """Refuse a grammar flag's value that the engine would refuse whatever the model (an
    invalid JSON Schema, a regex or EBNF grammar that does not parse) before the model loads:
    it used to fail the request, exit status 1, only after the load.

    Raises:
        ValueError: naming the flag (``--json-schema: Failed to compile json_schema grammar:
            invalid JSON Schema at /type: ...``).
    """
    if grammar is None:
        return
    # backends imported only when needed (each pulls in its native library)
    from structspec.grammar.compile_spec import with_backend_note
    from structspec.grammar.llg_compile import check_grammar_llguidance
    from structspec.grammar.precheck import check_grammar
    from structspec.grammar.select_backend import xgrammar_only

    backend = getattr(args, "grammar_backend", "xgrammar")
    flag = ("--json-schema" if args.json_schema is not None else
            "--regex" if args.regex is not None else
            "--choice" if getattr(args, "choice", None) is not None else
            "--structural-tag" if getattr(args, "structural_tag", None) is not None else
            "--ebnf")
    try:
        if backend == "llguidance":
            check_grammar_llguidance(grammar)
        elif backend == "auto" and not xgrammar_only(grammar):
            # refused only when neither backend could serve it
            try:
                check_grammar(grammar)
            except ValueError as xgr_error:
                try:
                    check_grammar_llguidance(grammar)
                except ValueError as llg_error:
                    raise ValueError(with_backend_note(str(llg_error), "xgrammar",
                                                       str(xgr_error))) from None
        else:
            check_grammar(grammar)
    except ValueError as e:
        # the engine's words name the request field ("strict false"); here it is a flag
        message = str(e).replace("best effort (strict false)", "best effort (--no-strict)")
        message = message.replace("set strict to false (best effort)", "pass --no-strict")
        raise ValueError(f"{flag}: {message}") from None


_GRAMMAR_KEYS = ("json_schema", "json_object", "regex", "ebnf", "choice", "structural_tag")
_PENALTY_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_BATCH_KEYS = frozenset({"prompt", "messages", "strict", "bounded_numbers", "max_tokens",
                         "min_tokens",
                         "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                         "include_stop_str_in_output", "skip_special_tokens",
                         "logit_bias", "repetition_stop", *_PENALTY_KEYS, *_GRAMMAR_KEYS})


def _check_record(rec: Any) -> None:
    """Reject a ``--batch`` line that is not an object, has keys the CLI does not read, asks
    for two grammars, or has both or neither of ``prompt`` and ``messages``. The values are
    checked by :func:`_batch_grammar` and :func:`_check_prompt`.

    Raises:
        ValueError: naming the offending key(s).
    """
    if not isinstance(rec, dict):
        raise ValueError(f"not a JSON object: {type(rec).__name__}")
    unknown = sorted(set(rec) - _BATCH_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(sorted(_BATCH_KEYS))})")
    # json_object false asks for no grammar (as _batch_grammar reads it)
    grammars = [k for k in _GRAMMAR_KEYS if k in rec and (k != "json_object" or rec[k])]
    if len(grammars) > 1:
        raise ValueError(f"more than one grammar key ({', '.join(map(repr, grammars))}); "
                         "give at most one")
    if "prompt" in rec and "messages" in rec:
        raise ValueError("both 'prompt' and 'messages'; give one")
    if "prompt" not in rec and "messages" not in rec:
        raise ValueError("no 'prompt' or 'messages'; give one")


def _batch_grammar(rec: dict[str, Any], default: GrammarConstraint | None, *,
                   unbounded_numbers: bool = False) -> GrammarConstraint | None:
    """The grammar of one ``--batch`` line (checked by :func:`_check_record`), ``default``
    (the command line's) when it names none. ``bounded_numbers: false`` on the line (or
    ``--unbounded-numbers`` without a line value) lifts a JSON grammar's number bounds.

    Values of the wrong JSON type are refused, not coerced: ``str()`` made ``null`` the regex
    "None", ``"abc"`` the choices a/b/c and ``"false"`` a true ``strict``
    (:data:`~structspec.constraint_parse.BATCH_STYLE`).

    Raises:
        ValueError: naming the key and showing the value as it was on the line.
    """
    grammar = _line_grammar(rec, default)
    if "bounded_numbers" in rec:
        if not cp.boolean_field(rec["bounded_numbers"], "bounded_numbers", cp.BATCH_STYLE):
            grammar = cp.without_number_bounds(grammar, "bounded_numbers")
    elif unbounded_numbers and isinstance(grammar, (JsonSchemaConstraint, JsonObjectConstraint,
                                                    StructuralTagConstraint)):
        grammar = cp.without_number_bounds(grammar, "--unbounded-numbers")
    return grammar


def _line_grammar(rec: dict[str, Any],
                  default: GrammarConstraint | None) -> GrammarConstraint | None:
    """The grammar keys of one ``--batch`` line (see :func:`_batch_grammar`)."""
    style = cp.BATCH_STYLE
    strict = cp.boolean_field(rec["strict"], "strict", style) if "strict" in rec else True
    json_object = ("json_object" in rec
                   and cp.boolean_field(rec["json_object"], "json_object", style))
    if "json_schema" in rec:
        return cp.json_schema_constraint(rec["json_schema"], "json_schema", style,
                                         strict=strict)
    if json_object:
        return JsonObjectConstraint()
    if "regex" in rec:
        return cp.regex_constraint(rec["regex"], "regex", style)
    if "ebnf" in rec:
        return cp.ebnf_constraint(rec["ebnf"], "ebnf", style)
    if "choice" in rec:
        return cp.choice_constraint(rec["choice"], "choice", style)
    if "structural_tag" in rec:
        return cp.structural_tag_constraint(rec["structural_tag"], "structural_tag", style,
                                            strict=strict)
    return default


def _is_token_id(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (JSON ``true`` is not token id 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_prompt(rec: dict[str, Any]) -> None:
    """Refuse a ``--batch`` ``prompt`` of the wrong JSON type (``[true, false]`` used to be
    token ids). A chat given as ``prompt`` is checked in :func:`_batch_request`; an empty
    string fails its line in the engine, as in the Python API.

    Raises:
        ValueError: naming ``'prompt'`` and showing its value.
    """
    if "prompt" not in rec:
        return
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return  # a chat: checked (and named) by check_chat_messages in _batch_request
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return
    raise ValueError("'prompt' must be a string, a non-empty list of integer token ids "
                     f"or a list of chat messages, got {cp.shown_json(prompt)}")


def _params(args: argparse.Namespace, grammar: GrammarConstraint | None,
            rec: dict[str, Any] | None = None) -> SamplingParams:
    rec = rec or {}
    stop = rec.get("stop", args.stop)
    if stop is None:  # a --batch line's "stop": null, as the server and SamplingParams take it
        stop = ()
    if not isinstance(stop, (str, list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    if "logit_bias" in rec:
        logit_bias = logit_bias_from_json(rec["logit_bias"])
    else:
        logit_bias = _flag_logit_bias(args.logit_bias)
    if "repetition_stop" in rec:
        repetition_stop = repetition_stop_from_json(rec["repetition_stop"])
    else:
        repetition_stop = _flag_repetition_stop(args.stop_on_repeat)
    # Values pass through unconverted: SamplingParams.validate names a bad one's field.
    return SamplingParams(
        max_tokens=rec.get("max_tokens", args.max_tokens),
        temperature=rec.get("temperature", args.temperature),
        top_p=rec.get("top_p", args.top_p),
        top_k=rec.get("top_k", args.top_k),
        min_p=rec.get("min_p", args.min_p),
        seed=rec.get("seed", args.request_seed),
        stop=tuple([stop] if isinstance(stop, str) else stop),
        include_stop_str_in_output=rec.get("include_stop_str_in_output",
                                           args.include_stop_str_in_output),
        skip_special_tokens=rec.get("skip_special_tokens", args.skip_special_tokens),
        grammar=grammar,
        presence_penalty=rec.get("presence_penalty", args.presence_penalty),
        frequency_penalty=rec.get("frequency_penalty", args.frequency_penalty),
        repetition_penalty=rec.get("repetition_penalty", args.repetition_penalty),
        logit_bias=logit_bias,
        repetition_stop=repetition_stop,
        min_tokens=rec.get("min_tokens", args.min_tokens),
    )


def _flag_logit_bias(value: str | None) -> dict[int, Any] | None:
    """``--logit-bias``: a JSON object (inline, or the path of a file holding one).

    Raises:
        ValueError: not JSON (a file's contents or the inline text), no such file, or not an
            object of token ids (naming ``--logit-bias``, or ``logit_bias`` for the object's
            entries).
    """
    if value is None:
        return None
    text = _read_text_arg(value, "--logit-bias")
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        if text is not value:  # read from the file
            raise ValueError(f"--logit-bias: {value!r} is not valid JSON: {e}") from None
        if not value.lstrip().startswith("{"):  # meant as a path, as --json-schema reads it
            raise ValueError(f"--logit-bias: no such file {value!r} (and not inline JSON)"
                             ) from None
        raise ValueError(f"--logit-bias: not a JSON object: {e}") from None
    return logit_bias_from_json(parsed)


def _flag_repetition_stop(min_tokens: int | None) -> RepetitionStop | None:
    """``--stop-on-repeat [MIN_TOKENS]`` (None: not given)."""
    if min_tokens is None:
        return None
    return RepetitionStop(min_tokens=min_tokens)


def _record_error_param(error: BaseException) -> str | None:
    """The ``--batch`` line's key that a refusal of the line names (its output record's
    ``error_param``, as the server's 400 ``param`` and the Python API's ``error_param``): a
    grammar field's or a chat message's own field, else the key the message starts with
    (``max_tokens must be >= 1``, ``'prompt': ...``, ``stop must be ...``); None for a
    refusal of the whole line (not JSON, unknown keys, two grammars)."""
    if isinstance(error, cp.ConstraintFieldError):
        return error.field
    if isinstance(error, ChatMessageError):
        return error.param
    head = re.split(r"[ .\[:]", str(error), maxsplit=1)[0].strip("'")
    return head if head in _BATCH_KEYS else None


def _batch_request(args: argparse.Namespace, rec: Any,
                   default_grammar: GrammarConstraint | None) -> tuple[Any, SamplingParams]:
    """The prompt (text, or checked chat messages) and sampling params of one parsed
    ``--batch`` line, checked before the model loads so that a bad line names its line.

    Raises:
        ValueError / TypeError: the line is not JSON (``rec`` is the parse error), has bad
            keys or values (see :func:`_check_record`, :func:`_batch_grammar`,
            :meth:`SamplingParams.validate`), or malformed ``messages``
            (:class:`ChatMessageError`, naming the message field).
    """
    if isinstance(rec, json.JSONDecodeError):
        raise ValueError(f"not JSON: {rec}")
    if isinstance(rec, ValueError):  # the line's bytes did not decode (see _read_batch)
        raise rec
    _check_record(rec)
    grammar = _batch_grammar(rec, default_grammar, unbounded_numbers=args.unbounded_numbers)
    _check_prompt(rec)
    params = _params(args, grammar, rec)
    params.validate()
    if params.max_tokens > MAX_TOKENS_FLAG:  # as the --max-tokens flag refuses it
        raise ValueError(_too_many_tokens("max_tokens", params.max_tokens))
    if "messages" in rec:
        return check_chat_messages(rec["messages"]), params
    prompt = rec.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        try:  # a chat given as 'prompt' (LLM.generate accepts one): checked like messages
            return check_chat_messages(prompt), params
        except ChatMessageError as e:
            raise ValueError(f"'prompt': {e}") from e
    return prompt, params


# SamplingParams fields whose flag is spelled differently from the field (validate() names
# the field; a command-line error names the flag the user typed).
_FLAG_OF_FIELD = {"seed": "--request-seed", "max_tokens": "--max-tokens",
                  "min_tokens": "--min-tokens",
                  "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                  "min_p": "--min-p", "stop": "--stop", "presence_penalty": "--presence-penalty",
                  "frequency_penalty": "--frequency-penalty",
                  "repetition_penalty": "--repetition-penalty", "logit_bias": "--logit-bias",
                  "repetition_stop": "--stop-on-repeat"}


MAX_TOKENS_FLAG = 2**31 - 1
"""Largest ``--max-tokens`` accepted: above every model's context (the engine stops an answer
at the context length), far below where an int64 token count would overflow."""


def _too_many_tokens(name: str, value: int) -> str:
    """The refusal of a ``max_tokens`` above :data:`MAX_TOKENS_FLAG` (flag or ``--batch`` key)."""
    return (f"{name}: {value} is more than any model's context; give at most "
            f"{MAX_TOKENS_FLAG} (the answer stops at the context length anyway)")


def _model_flags_error(args: argparse.Namespace) -> str | None:
    """Why ``--model``, the drafter flags or ``--chat-template`` cannot run, else None: the
    last checks before the model loads (after every other flag's, so that a bad value of
    another flag is named even where the model path does not exist)."""
    try:
        check_model_and_draft_flags(args.model, args.speculative_algorithm, args.draft_model,
                                    args.load_format)
        if args.chat_template is not None:
            load_chat_template(args.chat_template, "--chat-template")
    except ValueError as e:
        return str(e)
    return None


def _warn_unused_flags(args: argparse.Namespace) -> None:
    """Say on stderr which speculative flags the chosen drafter ignores
    (:func:`~structspec.engine_args.unused_speculative_flags`); the run goes on."""
    for flag in unused_speculative_flags(args):
        print(f"structspec generate: warning: {flag} has no effect with "
              f"--speculative-algorithm {args.speculative_algorithm}", file=sys.stderr)


def _logit_bias_flag_out_of_vocab(args: argparse.Namespace, llm: Any) -> str | None:
    """Why ``--logit-bias`` names a token id the loaded model does not have, else None.

    The vocabulary is known only once the model has loaded; the flag is still a bad command
    line (exit 2 naming it), not a failed request.
    """
    bias = _flag_logit_bias(args.logit_bias)
    vocab_size = llm.engine.model_config.vocab_size
    bad_id = out_of_vocab(bias, vocab_size)
    if bad_id is None:
        return None
    return (f"--logit-bias: token id {bad_id} is not in this model's vocabulary (ids 0.."
            f"{vocab_size - 1})")


def output_format(args: argparse.Namespace) -> str:
    """``--output``, or its default: ``json`` for ``--batch`` (records carry each line's
    finish reason and error), ``text`` for one prompt."""
    if args.output is not None:
        return str(args.output)
    return "json" if args.batch else "text"


def _check_out_file(path: str) -> None:
    """Refuse an ``--out-file`` that cannot be written, before the model loads and the batch
    runs (it used to fail only when the results were written, losing them all). Probed by
    writing (:func:`structspec.write_probe.probe_file_writable`), not with ``os.access``,
    which root passes on read-only places such as ``/sys``; the file itself is neither
    created nor truncated here, so a run that fails to start keeps an earlier results file.

    Raises:
        ValueError: naming ``--out-file``: a directory, a missing parent, or a file that
            cannot be written (the system's reason).
    """
    out = Path(path)
    parent = out.parent
    if out.is_dir():
        raise ValueError(f"--out-file: {path!r} is a directory")
    if not parent.is_dir():
        raise ValueError(f"--out-file: directory {str(parent)!r} does not exist")
    try:
        probe_file_writable(out)
    except OSError as e:
        raise ValueError(f"--out-file: {path!r} is not writable: {e.strerror or e}") from e


def _read_batch(path: str) -> list[tuple[int, Any]]:
    """The non-blank lines of the ``--batch`` file: (1-based line number, the parsed JSON, or
    the decode/parse error, which fails that line alone).

    The file is read as bytes and decoded line by line, so that one line of invalid UTF-8
    fails alone instead of aborting the batch; a UTF-8 BOM before line 1 is skipped
    (``utf-8-sig``), as editors on Windows write one.

    Raises:
        ValueError: the file cannot be read (missing, a directory, no permission), naming
            ``--batch``.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"--batch: cannot read {path!r}: {e.strerror or e}") from e
    records: list[tuple[int, Any]] = []
    for lineno, raw in enumerate(data.splitlines(keepends=True), 1):
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            records.append((lineno, ValueError(f"not UTF-8: {_utf8_error_in_line(raw, e)}")))
            continue
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            records.append((lineno, e))  # fails alone, like any other bad line
    return records


def cmd_generate(args: argparse.Namespace) -> int:
    """``structspec generate``; returns the exit status (0 ok, 1 a request failed, 2 bad
    command line).

    Raises:
        ValueError / FileNotFoundError / MemoryError: from loading the model (``main`` turns
            them into exit status 2).
    """
    # imported here, not at the top: structspec.config imports torch, which `--help` and
    # the `serve` front end should not wait for
    from structspec.config import check_device

    try:
        # every command-line check comes before the model loads
        check_device(args.device)
        if args.prompt is not None and not args.prompt:
            # the engine refuses an empty prompt (as vLLM does); found only after the load,
            # it used to be exit status 1
            raise ValueError("--prompt: the prompt is empty; give some text")
        if args.max_tokens > MAX_TOKENS_FLAG:
            raise ValueError(_too_many_tokens("--max-tokens", args.max_tokens))
        grammar = grammar_from_args(args)
        _precheck_grammar(args, grammar)
        if args.out_file is not None and not args.batch:
            raise ValueError("--out-file needs --batch")
        if args.out_file is not None:
            _check_out_file(args.out_file)
        records: list[tuple[int, Any]] = _read_batch(args.batch) if args.batch else []
    except ValueError as e:
        print(f"structspec generate: {flag_error(str(e))}",
              file=sys.stderr)
        return 2
    from structspec.llm import LLM

    if args.batch:
        prompts: list[Any] = []
        params: list[SamplingParams] = []
        # index of a rejected line -> (why, its key, its code), for its output record
        bad: dict[int, tuple[str, str | None, str | None]] = {}
        for i, (lineno, rec) in enumerate(records):
            try:
                line_prompt, line_params = _batch_request(args, rec, grammar)
            except (TypeError, ValueError) as e:
                line_prompt, line_params = "", SamplingParams(max_tokens=-1)  # rejected below
                param = _record_error_param(e)
                bad[i] = (f"bad record at line {lineno}: {e}", param,
                          request_error_code(param, getattr(e, "code", None)))
                print(f"structspec generate: {args.batch}:{lineno}: bad record: {e}",
                      file=sys.stderr)
            prompts.append(line_prompt)
            params.append(line_params)
        if (why := _model_flags_error(args)) is not None:
            print(f"structspec generate: {why}", file=sys.stderr)
            return 2
        _warn_unused_flags(args)
        llm = LLM(args.model, **engine_kwargs(args))
        if (why := _logit_bias_flag_out_of_vocab(args, llm)) is not None:
            print(f"structspec generate: {why}", file=sys.stderr)
            return 2
        outs = llm.generate(prompts, params, raw_prompt=args.raw_prompt, use_tqdm=True)
        for i, (why, param, code) in bad.items():  # not the placeholder's max_tokens error
            outs[i] = RequestOutput.error_output(outs[i].request_id, why, param, code)
        for i, out in enumerate(outs):  # what the engine refused, named by its line too
            if out.error is not None and i not in bad:
                print(f"structspec generate: {args.batch}:{records[i][0]}: {out.error}",
                      file=sys.stderr)
        sink = open(args.out_file, "w") if args.out_file else sys.stdout  # noqa: SIM115
        try:
            print_batch(records, outs, params, output_format(args), sink)
        finally:
            if sink is not sys.stdout:
                sink.close()
        failed = [o for o in outs if o.error is not None]
        if failed:
            print(f"structspec generate: {len(failed)}/{len(outs)} requests failed "
                  f"(first: {failed[0].error})", file=sys.stderr)
        return 0 if not failed else 1

    prompt: Any
    if args.messages:
        try:  # a malformed message is a bad command line: exit 2, nothing loaded
            prompt = check_chat_messages(json.loads(Path(args.messages).read_text()))
        except (OSError, json.JSONDecodeError, ChatMessageError) as e:
            print(f"structspec generate: --messages: {e}", file=sys.stderr)
            return 2
    else:
        prompt = args.prompt
    try:
        sampling = _params(args, grammar)
        sampling.validate()  # a bad flag value is a bad command line: exit 2, nothing loaded
    except (TypeError, ValueError) as e:
        print(f"structspec generate: {flag_error(str(e), _FLAG_OF_FIELD)}", file=sys.stderr)
        return 2
    if (why := _model_flags_error(args)) is not None:
        print(f"structspec generate: {why}", file=sys.stderr)
        return 2
    _warn_unused_flags(args)
    llm = LLM(args.model, **engine_kwargs(args))
    if (why := _logit_bias_flag_out_of_vocab(args, llm)) is not None:
        print(f"structspec generate: {why}", file=sys.stderr)
        return 2
    out = llm.generate(prompt, sampling, raw_prompt=args.raw_prompt)[0]
    print_one(out, sampling, output_format(args))
    return 0 if out.error is None else 1


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: ...)`` unless the help text already says what the default is, or
    there is none to show (None, or False for an on/off flag, or the True of a flag that turns
    something off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text.lower() or action.default is None or action.default is False
                or isinstance(action, argparse._StoreFalseAction)):  # an off switch: default on
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``structspec`` command."""
    words = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(join_negative_values(words))
    if args.command == "generate":
        try:
            return cmd_generate(args)
        except (FileNotFoundError, ValueError, MemoryError) as e:
            print(f"structspec generate: {flag_error(str(e))}",
                  file=sys.stderr)
            return 2
    if args.command == "serve":
        from structspec.server.launch import serve

        return serve(args)
    if args.command == "train-eagle":
        return cmd_train_eagle(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
