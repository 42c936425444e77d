"""xgrammar structural tags, read and checked: the tag in its current form and the places
in it that hold a JSON Schema or a regex.

A structural tag lets the model write free text and, once it writes a trigger (``<function=``),
forces the tagged section: a begin string, a body (a JSON Schema, a regex, a grammar...) and an
end string. Two forms are read:

- xgrammar's current form, ``{"type": "structural_tag", "format": {...}}``
  (``xgrammar.StructuralTag``; ``format`` is one of the formats of :data:`FORMAT_FIELDS`);
- the legacy form of vLLM and of xgrammar's deprecated API, ``{"structures": [{"begin",
  "schema", "end"}], "triggers": [...]}`` (``type`` optional). It is converted to the current
  form exactly as xgrammar converts it (``StructuralTag.from_legacy_structural_tag``): one
  ``triggered_tags`` format whose tags hold ``json_schema`` contents.

Nothing in a tag is ignored: xgrammar's parser skips keys it does not know, so a misspelt option
(``"at_least_once"``) would change nothing without a word; here it is refused, naming it. Also
refused before any compile: a trigger that is not a prefix of any tag's ``begin`` (xgrammar
fails on it with an internal check), a ``begin`` that no trigger (or more than one) starts,
empty ``structures`` / ``triggers`` / ``tags``, and each embedded JSON Schema whose structure
the engine never serves (:func:`~structspec.schema_structure.find_structure_problem`) or regex
xgrammar would misread (:func:`~structspec.regex_check.find_regex_problem`). Whatever else
xgrammar refuses fails at compile, as any grammar's error.

Places are named in the client's form, relative to the tag: ``structures[0].schema``,
``format.tags[1].content.json_schema`` (:func:`field_name` puts a request field before them).
Torch- and xgrammar-free (the server's front end reads tags); the walk is iterative.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from structspec.constraints import json_type_name
from structspec.regex_check import find_regex_problem
from structspec.schema_structure import find_structure_problem

Path = tuple[str | int, ...]

MAX_FORMAT_NESTING = 32
"""Deepest nesting of formats in a tag (a ``sequence`` in a ``tag`` in ...); each format level is
two or three JSON levels, and a tag far deeper than any real one would only overflow the
pickling between the server's processes."""

JSON_SCHEMA_STYLES = ("json", "qwen_xml", "minimax_xml", "minimax_m3_xml", "deepseek_xml",
                      "glm_xml", "cohere_xml", "kimi_k3_xml", "deepseek_v4_1_xml")
"""The values of a ``json_schema`` format's ``style`` (xgrammar 0.2.8)."""

FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "const_string": {"value": "string"},
    "json_schema": {"json_schema": "schema", "style": "style", "any_order": "boolean",
                    "max_whitespace_cnt": "count", "excludes": "strings"},
    "qwen_xml_parameter": {"json_schema": "schema"},
    "any_text": {"excludes": "strings", "max_tokens": "count", "max_chars": "count"},
    "token": {"token": "token"},
    "exclude_token": {"exclude_tokens": "tokens"},
    "any_tokens": {"exclude_tokens": "tokens", "max_tokens": "count"},
    "grammar": {"grammar": "string"},
    "regex": {"pattern": "regex"},
    "sequence": {"elements": "formats"},
    "or": {"elements": "formats"},
    "tag": {"begin": "begin", "content": "format", "end": "end"},
    "triggered_tags": {"triggers": "strings", "tags": "tags", "at_least_one": "boolean",
                       "stop_after_first": "boolean", "excludes": "strings"},
    "token_triggered_tags": {"trigger_tokens": "tokens", "tags": "tags",
                             "exclude_tokens": "tokens", "at_least_one": "boolean",
                             "stop_after_first": "boolean"},
    "tags_with_separator": {"tags": "tags", "separator": "string", "at_least_one": "boolean",
                            "stop_after_first": "boolean"},
    "optional": {"content": "format"},
    "plus": {"content": "format"},
    "star": {"content": "format"},
    "repeat": {"min": "integer", "max": "integer", "content": "format"},
    "dispatch": {"rules": "rules", "loop": "boolean", "excludes": "strings"},
    "token_dispatch": {"rules": "token_rules", "loop": "boolean", "exclude_tokens": "tokens"},
}
"""Each format type (xgrammar 0.2.8's ``structural_tag.py``) -> its keys besides ``type`` and
what each holds. Every key is optional except those in :data:`REQUIRED_FIELDS`."""

REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "const_string": ("value",), "json_schema": ("json_schema",),
    "qwen_xml_parameter": ("json_schema",), "token": ("token",), "grammar": ("grammar",),
    "regex": ("pattern",), "sequence": ("elements",), "or": ("elements",),
    "tag": ("begin", "content", "end"), "triggered_tags": ("triggers", "tags"),
    "token_triggered_tags": ("trigger_tokens", "tags"), "tags_with_separator": ("tags", "separator"),
    "optional": ("content",), "plus": ("content",), "star": ("content",),
    "repeat": ("min", "max", "content"), "dispatch": ("rules",), "token_dispatch": ("rules",),
}
"""The keys each format type must have."""

LEGACY_STRUCTURE_KEYS = ("begin", "schema", "end")
"""The keys of one item of the legacy form's ``structures``."""

_MAX_COUNT = 2**31 - 1
_SCHEMA_FORMATS = ("json_schema", "qwen_xml_parameter")


class StructuralTagError(ValueError):
    """A structural tag refused before compiling.

    Attributes:
        where: the place in the tag, in the client's form (``structures[0].schema``; ``""``
            for the tag itself).
    """

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class SchemaSite:
    """A JSON Schema in a tag.

    Attributes:
        where: its place in the client's form (``structures[0].schema``).
        path: the path, in :attr:`ReadTag.tag`, of the format object that holds it (its
            ``json_schema`` key).
        schema: the schema (an object or a boolean).
    """

    where: str
    path: Path
    schema: Any


@dataclass(frozen=True)
class ReadTag:
    """A checked structural tag.

    Attributes:
        tag: the tag in xgrammar's current form (the client's own object for that form; a new
            one for the legacy form).
        schemas: its JSON Schemas, in document order.
        patterns: its regexes as ``(where, pattern)``.
        legacy: whether the client wrote the legacy form.
    """

    tag: dict[str, Any]
    schemas: tuple[SchemaSite, ...]
    patterns: tuple[tuple[str, str], ...]
    legacy: bool


def field_name(base: str, where: str) -> str:
    """``where`` (a place in a tag) under the field ``base`` that holds the tag:
    ``response_format`` + ``structures[0].schema`` -> ``response_format.structures[0].schema``."""
    if not where:
        return base
    return f"{base}{where}" if where.startswith("[") else f"{base}.{where}"


def render_path(path: Path) -> str:
    """A path as a place name: ``("format", "tags", 0, "content")`` -> ``format.tags[0].content``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def read_structural_tag(tag: Any) -> ReadTag:
    """Check a structural tag (either form; module docstring) and find its JSON Schemas.

    Args:
        tag: the parsed tag (a dict; anything else is refused).

    Returns:
        The tag in the current form with its schema and regex places.

    Raises:
        StructuralTagError: the first problem, with its place.
    """
    if not isinstance(tag, dict):
        raise StructuralTagError(f"a structural tag must be a JSON object, got "
                                 f"{json_type_name(tag)}", "")
    if "type" in tag and tag["type"] != "structural_tag":
        raise StructuralTagError(f"type must be 'structural_tag', got {tag['type']!r}", "type")
    if "structures" in tag or "triggers" in tag:
        if "format" in tag:
            raise StructuralTagError("give 'format' (the current form) or 'structures' and "
                                     "'triggers' (the legacy form), not both", "format")
        return _read_legacy(tag)
    _refuse_unknown(tag, (), ("type", "format"))
    if "format" not in tag:
        raise StructuralTagError("a structural tag needs 'format' (or the legacy "
                                 "'structures' and 'triggers')", "")
    reader = _FormatReader()
    reader.read(tag["format"], ("format",))
    return ReadTag(tag, tuple(reader.schemas), tuple(reader.patterns), legacy=False)


def _read_legacy(tag: dict[str, Any]) -> ReadTag:
    """The legacy form, checked and converted (module docstring)."""
    _refuse_unknown(tag, (), ("type", "structures", "triggers"))
    structures = tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise StructuralTagError("structures must be a non-empty list of {begin, schema, end} "
                                 f"objects, got {_shown_type(structures)}", "structures")
    triggers = _strings(tag.get("triggers"), ("triggers",), non_empty=True)
    tags: list[dict[str, Any]] = []
    sites: list[SchemaSite] = []
    for i, item in enumerate(structures):
        path: Path = ("structures", i)
        if not isinstance(item, dict):
            raise StructuralTagError(f"must be a {{begin, schema, end}} object, got "
                                     f"{json_type_name(item)}", render_path(path))
        _refuse_unknown(item, path, LEGACY_STRUCTURE_KEYS)
        for key in LEGACY_STRUCTURE_KEYS:
            if key not in item:
                raise StructuralTagError(f"missing '{key}'", render_path(path))
        begin = _string(item["begin"], (*path, "begin"))
        end = _string(item["end"], (*path, "end"))
        schema = item["schema"]
        where = render_path((*path, "schema"))
        _check_schema(schema, where)
        tags.append({"type": "tag", "begin": begin,
                     "content": {"type": "json_schema", "json_schema": schema}, "end": end})
        sites.append(SchemaSite(where, ("format", "tags", i, "content"), schema))
    _check_triggers(triggers, ("triggers",), [(("structures", i, "begin"), t["begin"])
                                              for i, t in enumerate(tags)])
    converted = {"type": "structural_tag",
                 "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    return ReadTag(converted, tuple(sites), (), legacy=True)


class _FormatReader:
    """The walk over a current-form tag's formats (iterative: a stack of pending nodes)."""

    def __init__(self) -> None:
        self.schemas: list[SchemaSite] = []
        self.patterns: list[tuple[str, str]] = []

    def read(self, root: Any, path: Path) -> None:
        # (node, path, format nesting, whether it is an item of a "tags" list)
        stack: list[tuple[Any, Path, int, bool]] = [(root, path, 1, False)]
        while stack:
            node, path, depth, in_tags = stack.pop()
            children = self._node(node, path, depth, in_tags)
            stack.extend(reversed(children))

    def _node(self, node: Any, path: Path, depth: int, in_tags: bool
              ) -> list[tuple[Any, Path, int, bool]]:
        where = render_path(path)
        if depth > MAX_FORMAT_NESTING:
            raise StructuralTagError(f"formats nest deeper than {MAX_FORMAT_NESTING} levels",
                                     where)
        if not isinstance(node, dict):
            raise StructuralTagError(f"a format must be a JSON object, got {json_type_name(node)}",
                                     where)
        kind = node.get("type", "tag" if in_tags else None)
        if in_tags and kind != "tag":
            raise StructuralTagError(f"an item of 'tags' is a tag format (type 'tag'), got "
                                     f"type {kind!r}", where)
        if kind is None:
            raise StructuralTagError("a format needs 'type' (one of "
                                     f"{', '.join(FORMAT_FIELDS)})", where)
        if not isinstance(kind, str) or kind not in FORMAT_FIELDS:
            raise StructuralTagError(f"unknown format type {kind!r}; expected one of "
                                     f"{', '.join(FORMAT_FIELDS)}", render_path((*path, "type")))
        fields = FORMAT_FIELDS[kind]
        _refuse_unknown(node, path, ("type", *fields))
        if kind in ("any_text", "any_tokens") and node.get("max_tokens") is not None:
            # xgrammar relaxes a spent token budget where the rule cannot end, and what it
            # allows then depends on the matcher's history: a draft tree's walk (rollbacks)
            # let a fifth token through a budget of 4 that plain decoding refused
            raise StructuralTagError(
                f"'max_tokens' of an {kind!r} format is not enforced exactly under speculative "
                "decoding (xgrammar's token budget depends on the matcher's rollbacks); bound "
                "the text with 'max_chars' or 'excludes' instead",
                render_path((*path, "max_tokens")))
        for key in REQUIRED_FIELDS.get(kind, ()):
            if key not in node:
                raise StructuralTagError(f"a {kind!r} format needs '{key}'", where)
        children: list[tuple[Any, Path, int, bool]] = []
        for key, what in fields.items():
            if key in node:
                children += self._field(node[key], (*path, key), what, depth)
        if kind == "repeat" and (node["min"] < 0 or node["max"] not in range(-1, 0)
                                 and node["max"] < node["min"]):
            raise StructuralTagError(f"a repeat needs 0 <= min <= max (max -1: unbounded), got "
                                     f"min {node['min']}, max {node['max']}", where)
        if kind in _SCHEMA_FORMATS:
            self.schemas.append(SchemaSite(render_path((*path, "json_schema")), path,
                                           node["json_schema"]))
        if kind == "triggered_tags":
            begins = []
            for i, tag in enumerate(node["tags"]):
                tag_path = (*path, "tags", i)
                if not isinstance(tag, dict) or "begin" not in tag:
                    raise StructuralTagError("a tag format needs 'begin'" if isinstance(
                        tag, dict) else f"a format must be a JSON object, got "
                        f"{json_type_name(tag)}", render_path(tag_path))
                begins.append(((*tag_path, "begin"), tag["begin"]))
            _check_triggers(node["triggers"], (*path, "triggers"), begins)
        return children

    def _field(self, value: Any, path: Path, what: str, depth: int
               ) -> list[tuple[Any, Path, int, bool]]:
        """Check one key's value; the formats inside it, to be read next."""
        where = render_path(path)
        if what == "format":
            return [(value, path, depth + 1, False)]
        if what in ("formats", "tags"):
            if not isinstance(value, list) or not value:
                raise StructuralTagError(f"must be a non-empty list of formats, got "
                                         f"{_shown_type(value)}", where)
            return [(v, (*path, i), depth + 1, what == "tags") for i, v in enumerate(value)]
        if what in ("rules", "token_rules"):
            return self._rules(value, path, depth, tokens=what == "token_rules")
        if what == "schema":
            _check_schema(value, where)
        elif what == "regex":
            _string(value, path)
            problem = find_regex_problem(value)
            if problem is not None:
                raise StructuralTagError(f"not a usable regex: {problem}", where)
            self.patterns.append((where, value))
        elif what == "begin":
            if not isinstance(value, str):
                return self._token_format(value, path, depth, "a string")
        elif what == "end":
            if isinstance(value, list):
                _strings(value, path, non_empty=False)
            elif not isinstance(value, str):
                return self._token_format(value, path, depth, "a string, a list of strings")
        else:
            _check_scalar(value, path, what)
        return []

    def _rules(self, value: Any, path: Path, depth: int, *, tokens: bool
               ) -> list[tuple[Any, Path, int, bool]]:
        """A ``dispatch`` format's ``[pattern, format]`` pairs."""
        pattern = "a token id or string" if tokens else "a string"
        if not isinstance(value, list) or not value:
            raise StructuralTagError(f"must be a non-empty list of [pattern, format] pairs, got "
                                     f"{_shown_type(value)}", render_path(path))
        out: list[tuple[Any, Path, int, bool]] = []
        for i, rule in enumerate(value):
            if not isinstance(rule, list) or len(rule) != 2:
                raise StructuralTagError(f"a rule is a [pattern, format] pair, got "
                                         f"{_shown_type(rule)}", render_path((*path, i)))
            if tokens:
                _check_scalar(rule[0], (*path, i, 0), "token")
            elif not isinstance(rule[0], str) or not rule[0]:
                raise StructuralTagError(f"the pattern must be {pattern} (non-empty)",
                                         render_path((*path, i, 0)))
            out.append((rule[1], (*path, i, 1), depth + 1, False))
        return out

    @staticmethod
    def _token_format(value: Any, path: Path, depth: int, alternatives: str
                      ) -> list[tuple[Any, Path, int, bool]]:
        """A ``begin`` / ``end`` that is not a string: it must be a ``token`` format."""
        if not isinstance(value, dict) or value.get("type") != "token":
            raise StructuralTagError(f"must be {alternatives} or a token format "
                                     f"({{\"type\": \"token\", ...}}), got {_shown_type(value)}",
                                     render_path(path))
        return [(value, path, depth + 1, False)]


def _check_triggers(triggers: Any, path: Path, begins: list[tuple[Path, Any]]) -> None:
    """Each trigger starts some ``begin``; each string ``begin`` starts with exactly one
    trigger (xgrammar's rule: a tag is dispatched by its trigger).

    Raises:
        StructuralTagError: naming the trigger or the ``begin``.
    """
    triggers = _strings(triggers, path, non_empty=True)
    for i, trigger in enumerate(triggers):
        if not trigger:
            raise StructuralTagError("a trigger must be a non-empty string",
                                     render_path((*path, i)))
    # linear in the text of the begins (a tag of 30,000 structures compared every begin
    # with every trigger: ~50 s of the server's event loop): each begin's prefixes are looked
    # up in the set of triggers
    trigger_set = set(triggers)
    longest = max(len(t) for t in triggers)
    used: set[str] = set()
    for begin_path, begin in begins:
        if not isinstance(begin, str):
            raise StructuralTagError("a triggered tag's begin must be a string (a token begin "
                                     "needs 'token_triggered_tags')", render_path(begin_path))
        matching = [begin[:n] for n in range(1, min(len(begin), longest) + 1)
                    if begin[:n] in trigger_set]
        if len(matching) != 1:
            what = "no trigger" if not matching else f"more than one trigger ({matching!r})"
            raise StructuralTagError(f"begin {begin!r} starts with {what}; each begin must "
                                     "start with exactly one of the triggers",
                                     render_path(begin_path))
        used.add(matching[0])
    for i, trigger in enumerate(triggers):
        if trigger not in used:
            raise StructuralTagError(f"trigger {trigger!r} is not a prefix of any tag's begin",
                                     render_path((*path, i)))


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, (dict, bool)):
        raise StructuralTagError(f"must be a JSON Schema (an object, or true / false), got "
                                 f"{json_type_name(schema)}", where)
    problem = find_structure_problem(schema)
    if problem is not None:
        raise StructuralTagError(f"the JSON Schema cannot be served: {problem}", where)


def _check_scalar(value: Any, path: Path, what: str) -> None:
    where = render_path(path)
    if what == "string":
        _string(value, path)
    elif what == "strings":
        _strings(value, path, non_empty=False)
    elif what == "boolean":
        if not isinstance(value, bool):
            raise StructuralTagError(f"must be true or false, got {_shown_type(value)}", where)
    elif what in ("integer", "count"):
        if what == "count" and value is None:
            return
        low = 0 if what == "count" else -1  # a repeat's max -1: unbounded (xgrammar's)
        if isinstance(value, bool) or not isinstance(value, int) or not (
                low <= value <= _MAX_COUNT):
            raise StructuralTagError(f"must be an integer in [{low}, {_MAX_COUNT}], got "
                                     f"{_shown_type(value)}", where)
    elif what == "style":
        if value not in JSON_SCHEMA_STYLES:
            raise StructuralTagError(f"unknown style {value!r}; expected one of "
                                     f"{', '.join(JSON_SCHEMA_STYLES)}", where)
    elif what == "token":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise StructuralTagError(f"must be a token id or a token string, got "
                                     f"{_shown_type(value)}", where)
    elif what == "tokens":
        if not isinstance(value, list):
            raise StructuralTagError(f"must be a list of token ids or strings, got "
                                     f"{_shown_type(value)}", where)
        for i, item in enumerate(value):
            _check_scalar(item, (*path, i), "token")


def _string(value: Any, path: Path) -> str:
    if not isinstance(value, str):
        raise StructuralTagError(f"must be a string, got {_shown_type(value)}",
                                 render_path(path))
    return value


def _strings(value: Any, path: Path, *, non_empty: bool) -> list[str]:
    if not isinstance(value, list) or (non_empty and not value):
        raise StructuralTagError(f"must be a {'non-empty ' if non_empty else ''}list of strings, "
                                 f"got {_shown_type(value)}", render_path(path))
    for i, item in enumerate(value):
        _string(item, (*path, i))
    return value


def _refuse_unknown(node: dict[str, Any], path: Path, known: tuple[str, ...]) -> None:
    for key in node:
        if key not in known:
            raise StructuralTagError(f"unknown key {key!r} (this object takes "
                                     f"{', '.join(known)})", render_path((*path, str(key))))


def _shown_type(value: object) -> str:
    """The JSON type, with the value when it is a scalar or empty (``array []``)."""
    if value in ([], {}) or value is None or isinstance(value, (bool, int, float)):
        return f"{json_type_name(value)} {json.dumps(value)}"
    return json_type_name(value)
