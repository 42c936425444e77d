"""A chat template given in place of the model's own (vLLM's ``--chat-template``).

:func:`load_chat_template` turns the option's value (the path of a Jinja file, or the
template text itself) into template text and checks its Jinja syntax, so that a bad template
is refused before any model loads, naming the option. The text then travels in
:attr:`structspec.config.EngineConfig.chat_template` to the tokenizer of the engine (and of
the server's front end), which renders every chat prompt with it.
"""

from __future__ import annotations

from pathlib import Path

#: Longest value tried as a path (a longer one is template text; ``Path.is_file`` on a very
#: long string raises ``OSError: File name too long``).
_MAX_PATH_CHARS = 4096


def load_chat_template(value: object, name: str) -> str:
    """The template text of a ``--chat-template`` / ``chat_template=`` value, checked.

    ``value`` is read as a file when a file of that name exists; otherwise it is the
    template itself, which must contain a Jinja tag (``{{ ... }}`` or ``{% ... %}``), so
    that a mistyped path is reported as one instead of becoming a template that prints its
    own name.

    Args:
        value: a path or template text.
        name: the option, for messages (``--chat-template`` or ``chat_template``).

    Raises:
        ValueError: starting with ``name``: not a string, empty, a missing or unreadable
            file, or Jinja that does not parse (with the line of the error).
    """
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a template file path or Jinja text, got "
                         f"{type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name}: empty template")
    path = Path(value).expanduser()
    text = value
    if len(value) < _MAX_PATH_CHARS and "\n" not in value and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: cannot read {value!r}: {e}") from e
        if not text.strip():
            raise ValueError(f"{name}: empty template file {value!r}")
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"{name}: no such file {value!r} (and not an inline Jinja template: "
                         "no '{{ ... }}' or '{% ... %}')")
    check_template_syntax(text, name)
    return text


def check_template_syntax(text: str, name: str) -> None:
    """Parse ``text`` with the Jinja environment transformers renders chat templates in.

    Raises:
        ValueError: ``{name}: Jinja syntax error at line N: ...``.
    """
    import jinja2

    try:
        # transformers' own compile (its sandbox, extensions and filters), so a template it
        # renders is never refused here; a plain Jinja parse if that private helper moves
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        def _compile_jinja_template(source: str) -> object:
            return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{name}: Jinja syntax error at line {e.lineno}: {e.message}"
                         ) from None
