"""Committing a verify step's accepted run to a request: the only place outputs grow.

Three phases per request and step (docs/architecture.md, invariants 3 and 4):

A. :func:`commit_tokens` (right after the step's results reach the host): trim the run at
   token-level stops (EOS, stop token ids, the repetition stop, max_tokens) and append the
   kept ids. The next
   step's tree is drafted from these ids.
B. The *grammar barrier* (with overlap it runs after the next verify launch, under the GPU
   forward): the grammar state advances over the ids committed since the last barrier, exactly
   once. It must run before the next bitmask is built, which reads that state. Either
   :func:`advance_grammar` advances the request's own matcher, or a mask worker's mirror
   matcher advances (the worker pool) and :func:`settle_grammar_advance` applies
   its verdict (predicted from the ids before the mirror has advanced, then checked); the host
   matcher then lags behind (``Req.num_grammar_advanced``) and catches up in
   :func:`advance_grammar` only when the host needs it again.
C. :func:`process_text` (with overlap: after the next launch too): detokenize, apply stop
   strings (the text is cut before the stop string, or after it with
   ``include_stop_str_in_output``; the ids keep the token that completed it either way);
   ids past a stop string are removed again and rolled back from the matcher, so the
   matcher has accepted exactly the committed ids.

Whatever is cut is never emitted, counted or kept: a cut always finishes the request, whose KV
pages are then freed whole.
"""

from __future__ import annotations

from structspec.constraints import PARAM_BY_KIND
from structspec.core import INVALID_REQUEST_PARAMETER, FinishReason, stop_token_hidden
from structspec.grammar.matchers import allows_no_token
from structspec.penalty_params import REPETITION_STOP_REASON
from structspec.scheduler.request import Req
from structspec.stop_strings import first_stop_ending_after


def cut_run(req: Req, run: list[int]) -> tuple[list[int], FinishReason | None, str | int | None]:
    """Trim ``run`` at the first EOS / stop token id (kept), at the token that completes a
    loop (the request's repetition stop, :mod:`~structspec.scheduler.repeat_stop`; kept) or at
    ``max_new_tokens``.

    The repetition stop's detector sees the kept tokens only, one at a time, so a multi-token
    run stops at the token where plain decoding would have stopped.

    Returns:
        ``(kept, finish_reason or None, stop_reason or None)``: the id of a
        ``stop_token_ids`` token, None for the model's EOS (as vLLM reports it), or
        ``"repetition"`` (with ``length``).
    """
    room = req.max_new_tokens - len(req.output_ids)
    detector = req.repeat_detector
    for i, tok in enumerate(run):
        if tok in req.eos_token_ids and not req.params.ignore_eos:
            return run[: i + 1], FinishReason.STOP, None
        if tok in req.params.stop_token_ids:
            return run[: i + 1], FinishReason.STOP, tok
        if detector is not None and detector.push(tok):
            return run[: i + 1], FinishReason.LENGTH, REPETITION_STOP_REASON
        if i + 1 >= room:
            return run[: i + 1], FinishReason.LENGTH, None
    return run, None, None


#: the error of a request whose step found its logits not finite (select_verify committed no
#: token for it); the other requests of the batch are not affected
#: the error of a request with allowed_token_ids whose step left it no token to choose (the
#: grammar allowed none of them; or the model's logits were not finite)
NO_ALLOWED_TOKEN_ERROR = ("no token is allowed both by allowed_token_ids and by the grammar "
                          "at this point of the output (or the model produced non-finite "
                          "logits); the request was stopped")

#: the error of a request with one-token bad_words whose step left it no token to choose (the
#: grammar allowed nothing but banned tokens; or the model's logits were not finite)
NO_UNBANNED_TOKEN_ERROR = ("the grammar allows no token here that is not a bad_words token "
                           "(or the model produced non-finite logits); the request was stopped")

NON_FINITE_LOGITS_ERROR = ("the model produced non-finite logits (NaN or inf) for this "
                           "request; it was stopped")

#: the error of a constrained request whose step left it no token to choose: the grammar
#: reached a state that allows no token (a schema part that accepts no value, e.g. a property
#: whose ``$ref`` only refers to itself, which the grammar compiler let through); a 400 naming
#: the grammar's field, not a model fault
GRAMMAR_DEAD_END_ERROR = ("the grammar allows no token at this point of the output: the "
                          "schema (or grammar) cannot be completed from here, e.g. a property "
                          "whose schema accepts no value (or the model produced non-finite "
                          "logits); the request was stopped")


def commit_tokens(req: Req, run: list[int], now_s: float) -> list[int]:
    """Phase A: append the kept part of ``run``; returns the kept ids.

    An empty ``run`` is a step that committed nothing for the request because its logits
    were not finite (:func:`~structspec.scheduler.select_verify.select_verify`): the request
    ends with an error (docs/architecture.md, invariant 5)."""
    if req.finished:
        return []
    if not run:
        if req.params.allowed_token_ids is not None:
            # its other logits are -inf: the grammar allowed none of its tokens here
            req.finish(FinishReason.ABORT, error=NO_ALLOWED_TOKEN_ERROR,
                       error_param="allowed_token_ids", error_code=INVALID_REQUEST_PARAMETER)
        elif req.bad_words is not None and req.bad_words.single:
            # its bad tokens are -inf: the grammar allowed nothing else here
            req.finish(FinishReason.ABORT, error=NO_UNBANNED_TOKEN_ERROR,
                       error_param="bad_words", error_code=INVALID_REQUEST_PARAMETER)
        elif _grammar_dead_end(req):
            assert req.params.grammar is not None
            req.finish(FinishReason.ABORT, error=GRAMMAR_DEAD_END_ERROR,
                       error_param=PARAM_BY_KIND[req.params.grammar.kind],
                       error_code=INVALID_REQUEST_PARAMETER)
        elif not req.finished:
            req.finish(FinishReason.ABORT, error=NON_FINITE_LOGITS_ERROR)
        return []
    run, reason, stop_reason = cut_run(req, run)
    req.output_ids.extend(run)
    if req.first_token_time is None:
        req.first_token_time = now_s
    if reason is not None:
        req.finish(reason, stop_reason=stop_reason)
    return run


def _grammar_dead_end(req: Req) -> bool:
    """Whether ``req``'s grammar allows no token after its committed output (why a step
    committed nothing for it, rather than the model's non-finite logits): its host matcher,
    brought up to the output first (:func:`advance_grammar`, each id once), fills one mask
    row. False without a matcher, or when the advance itself ended the request."""
    if req.matcher is None:
        return False
    advance_grammar(req)
    return not req.finished and req.matcher is not None and allows_no_token(req.matcher)


def advance_grammar(req: Req) -> None:
    """Phase B on the host: advance ``req.matcher`` over the output ids it has not accepted yet
    (those committed since the last barrier, plus any a mirror matcher advanced instead), once.

    A token the grammar rejects (impossible when masks are applied: a bug or a timed-out tree
    walk) ends the request with an error; ids after the grammar's end are removed.
    """
    if req.matcher is None:
        return
    run = req.output_ids[req.num_grammar_advanced:]
    if not run:
        return
    kept = req.matcher.accept_run(run)
    req.num_grammar_advanced += kept
    settle_grammar_advance(req, len(run) - kept, req.matcher.is_terminated())


def settle_grammar_advance(req: Req, num_rejected: int, terminated: bool) -> None:
    """Apply a grammar advance's verdict to the request (phase B's bookkeeping).

    Args:
        req: the request whose newest output ids were advanced over.
        num_rejected: how many of the newest output ids the matcher did not keep (past the
            grammar's end, or from the first rejected id on); they are removed.
        terminated: the matcher reached the grammar's end.
    """
    if num_rejected:
        first_rejected = req.output_ids[len(req.output_ids) - num_rejected]
        cut_output(req, len(req.output_ids) - num_rejected)
        if not terminated:
            req.finish(FinishReason.ABORT, force=True, error=f"grammar rejected token "
                       f"{first_rejected} after {len(req.output_ids)} output tokens")
            return
    if terminated:
        req.finish(FinishReason.STOP)


def cut_output(req: Req, keep: int) -> int:
    """Remove the output ids from ``keep`` on, before they are reported; returns how many.

    Ids that were already detokenized (with overlap, the text work of a step may run before
    the grammar verdict on its ids arrives) have their text rebuilt from the kept ids, so the
    text never shows a removed id.
    """
    cut = len(req.output_ids) - keep
    if cut <= 0:
        return 0
    del req.output_ids[keep:]
    req.spec.committed_tokens -= cut
    if req.num_detokenized > keep:
        req.num_detokenized = keep
        if req.detokenizer is not None:
            req.text = req.detokenizer.restart(req.output_ids)
    return cut


def process_text(req: Req) -> None:
    """Phase C: detokenize new ids and cut at the first stop string (across token bounds).

    The id that ended the request at token level (EOS, a ``stop_token_ids`` id, the grammar's
    stop token) is counted but not detokenized unless ``include_stop_str_in_output``
    (:func:`~structspec.core.stop_token_hidden`): phase A (and B) finished the request before
    its run gets here."""
    stops = req.params.stop
    text_end = len(req.output_ids)
    if stop_token_hidden(req.params, req.finish_reason, req.stop_reason):
        text_end -= 1
    if not stops:
        if req.detokenizer is not None and req.num_detokenized < text_end:
            # No stop string to look for: detokenize the whole run at once (two decodes per
            # step instead of two per token; the text is the same).
            req.text += req.detokenizer.add(req.output_ids[req.num_detokenized:text_end])
        # Without a detokenizer (a front end that detokenizes itself) there is no text to
        # make: the ids are passed as a whole instead of one loop turn per token.
        req.num_detokenized = len(req.output_ids)
        return
    while req.num_detokenized < text_end:
        tok = req.output_ids[req.num_detokenized]
        req.num_detokenized += 1
        new_text = req.detokenizer.add([tok]) if req.detokenizer is not None else ""
        if not new_text:
            continue
        start = len(req.text)
        req.text += new_text
        if req.num_detokenized <= req.params.min_tokens:
            continue  # min_tokens: no stop string ends the output before its token count
        hit = first_stop_ending_after(req.text, stops, start)
        if hit is None:
            continue
        idx, s = hit
        # the text ends before the stop string, or after it (vLLM's include_stop_str_in_output);
        # what the completing token decoded to past it is dropped either way
        req.text = req.text[:idx + len(s) if req.params.include_stop_str_in_output else idx]
        if cut_output(req, req.num_detokenized):  # they came from the last verify run
            if req.matcher is not None and req.num_grammar_advanced > len(req.output_ids):
                # Only ids the host matcher already accepted are rolled back (a mirror
                # matcher's request finishes here, so its mirror is dropped with it).
                req.matcher.rollback(req.num_grammar_advanced - len(req.output_ids))
                req.num_grammar_advanced = len(req.output_ids)
        req.finish(FinishReason.STOP, force=True, stop_reason=s)
        return
    req.num_detokenized = len(req.output_ids)  # a hidden stop token is counted all the same


def commit_run(req: Req, run: list[int], now_s: float) -> int:
    """All three phases at once (the synchronous path); returns ids committed."""
    before = len(req.output_ids)
    if req.finished:
        return 0
    commit_tokens(req, run, now_s)
    advance_grammar(req)
    process_text(req)
    return len(req.output_ids) - before
