"""Committing a verify step's accepted run to a request: the only place outputs grow.

Order per request and step (invariants 3 and 4 of DESIGN.md):
1. :func:`cut_run` trims the run at token-level stops (EOS, stop token ids, max_tokens).
2. :func:`advance_grammar` advances the matcher over the trimmed run exactly once, stopping
   after the token that terminates the grammar.
3. :func:`append_tokens` appends token by token, detokenizes, and cuts at a stop string; tokens
   cut here are rolled back from the matcher so it has accepted exactly the committed tokens.
Whatever is cut is never emitted, counted or kept: a cut always finishes the request, whose KV
pages are then freed whole.
"""

from __future__ import annotations

from structspec.core import FinishReason
from structspec.scheduler.request import Req


def cut_run(req: Req, run: list[int]) -> tuple[list[int], FinishReason | None, int | None]:
    """Trim ``run`` at the first EOS / stop token id (kept) or at ``max_new_tokens``.

    Returns:
        ``(kept, finish_reason or None, stop_token or None)``.
    """
    room = req.max_new_tokens - len(req.output_ids)
    for i, tok in enumerate(run):
        if (tok in req.eos_token_ids and not req.params.ignore_eos) or (
            tok in req.params.stop_token_ids
        ):
            return run[: i + 1], FinishReason.STOP, tok
        if i + 1 >= room:
            return run[: i + 1], FinishReason.LENGTH, None
    return run, None, None


def advance_grammar(req: Req, run: list[int]) -> tuple[list[int], bool]:
    """Advance ``req.matcher`` over ``run`` once; return ``(retained, grammar_terminated)``.

    Raises nothing: a token the grammar rejects (impossible when masks are applied, so a bug
    or a timed-out tree walk) ends the request with an error instead.
    """
    if req.matcher is None or not run:
        return run, False
    kept = req.matcher.accept_run(run)
    if kept < len(run) and not req.matcher.is_terminated():
        req.finish(FinishReason.ABORT, error=f"grammar rejected token {run[kept]} "
                   f"after {len(req.output_ids) + kept} output tokens")
        return run[:kept], False
    return run[:kept], req.matcher.is_terminated()


def append_tokens(req: Req, run: list[int], now_s: float) -> int:
    """Append ``run`` (already cut and grammar-advanced) and apply stop strings.

    Returns:
        The number of tokens committed (may be fewer than ``len(run)`` after a stop string).
    """
    stops = req.params.stop
    committed = 0
    for tok in run:
        req.output_ids.append(tok)
        req.pending_ids.append(tok)
        committed += 1
        if req.first_token_time is None:
            req.first_token_time = now_s
        new_text = req.detokenizer.add([tok]) if req.detokenizer is not None else ""
        if not new_text:
            continue
        start = len(req.text)
        req.text += new_text
        if stops:
            longest = max(len(s) for s in stops)
            window_start = max(0, start - longest + 1)
            hit = _first_stop(req.text, stops, window_start)
            if hit is not None:
                idx, s = hit
                req.text = req.text[:idx]
                req.finish(FinishReason.STOP, stop_reason=s)
                break
    excess = len(run) - committed
    if excess and req.matcher is not None:
        req.matcher.rollback(excess)
    return committed


def _first_stop(text: str, stops: tuple[str, ...], from_idx: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, from_idx)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best


def commit_run(req: Req, run: list[int], now_s: float) -> int:
    """Apply one step's accepted run to ``req`` (steps 1-3 above); returns tokens committed."""
    if req.finished or not run:
        return 0
    run, reason, stop_tok = cut_run(req, run)
    run, terminated = advance_grammar(req, run)
    if req.finished:  # grammar rejected a token
        return append_tokens(req, run, now_s)
    n = append_tokens(req, run, now_s)
    if not req.finished:
        if reason is not None:
            req.finish(reason, stop_reason=stop_tok)
        elif terminated:
            req.finish(FinishReason.STOP)
    return n
