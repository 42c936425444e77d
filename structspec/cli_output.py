"""How ``structspec generate`` prints its results: ``--output text`` (the answers' text) or
``--output json`` (one record per request), and the stderr notice of an answer cut short.

Text mode prints only text, as a user of vLLM's or sglang's offline examples expects; a
``--batch`` in text mode prints one block per record, each under a ``### line N`` header (the
input line, blank lines counted, as the JSON records' ``line`` field). An answer that stopped
at ``length`` looks finished in text, so a one-line notice on stderr says where it stopped;
the exit status stays 0 (as vLLM's ``finish_reason`` is data, not an error).
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from structspec.core import FinishReason, RequestOutput, SamplingParams


def length_notice(out: RequestOutput, params: SamplingParams,
                  limit: str = "--max-tokens") -> str | None:
    """The stderr notice of an answer that finished with ``length``, else None.

    ``[finish_reason=length: stopped at --max-tokens 10]`` (``limit`` names where the limit
    came from: the flag, or ``max_tokens`` for a ``--batch`` record, whose line may set it),
    or the repetition stop
    (``stop_reason`` ``repetition``, from ``--stop-on-repeat``), or the model's context
    length when fewer than ``max_tokens`` tokens came out.
    """
    if out.error is not None or out.finish_reason != FinishReason.LENGTH:
        return None
    if out.stop_reason == "repetition":
        why = "the output repeated itself (--stop-on-repeat)"
    elif out.num_completion_tokens >= params.max_tokens:
        why = f"stopped at {limit} {params.max_tokens}"
    else:
        why = (f"stopped after {out.num_completion_tokens} tokens at the context length "
               "(--max-model-len)")
    return f"[finish_reason=length: {why}]"


def print_one(out: RequestOutput, params: SamplingParams, fmt: str,
              file: IO[str] | None = None) -> None:
    """Print the result of a ``--prompt`` / ``--messages`` request.

    Args:
        out: the request's output.
        params: its sampling parameters (for the ``length`` notice).
        fmt: ``"text"`` (the completion, a failed request's error on stderr) or ``"json"``
            (``out.to_dict()`` as one line).
        file: where the result goes (stdout by default); notices and errors go to stderr.
    """
    file = file if file is not None else sys.stdout
    if fmt == "json":
        print(json.dumps(out.to_dict()), file=file, flush=True)
    elif out.error:
        print(f"error: {out.error}", file=sys.stderr)
    else:
        print(out.text, file=file, flush=True)
        _notice(out, params)


def print_batch(records: list[tuple[int, Any]], outs: list[RequestOutput],
                params: list[SamplingParams], fmt: str, file: IO[str]) -> None:
    """Print the results of a ``--batch`` run, one per input record, in input order.

    Args:
        records: ``(input line number, parsed line)`` of each record.
        outs: the records' outputs (same order).
        params: the records' sampling parameters (for the ``length`` notices).
        fmt: ``"json"``: one JSONL record each, with its ``line``; ``"text"``: a ``### line
            N`` header, then the text (a failed record: ``### line N: error``; its error is
            on stderr).
        file: stdout or the ``--out-file``.
    """
    for (lineno, _), out, p in zip(records, outs, params, strict=True):
        if fmt == "json":
            # "line": the input line (1-based, blank lines counted), so that a record, above
            # all an error, can be matched to its line without stderr
            print(json.dumps({"line": lineno, **out.to_dict()}), file=file, flush=True)
        elif out.error is not None:
            print(f"### line {lineno}: error", file=file, flush=True)
        else:
            print(f"### line {lineno}", file=file)
            print(out.text, file=file, flush=True)
            _notice(out, p, prefix=f"line {lineno}: ", limit="max_tokens")


def _notice(out: RequestOutput, params: SamplingParams, prefix: str = "",
            limit: str = "--max-tokens") -> None:
    notice = length_notice(out, params, limit)
    if notice is not None:
        print(f"{prefix}{notice}", file=sys.stderr, flush=True)
