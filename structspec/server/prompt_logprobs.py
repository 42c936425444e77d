"""Prompt log-probabilities in responses: vLLM's ``prompt_logprobs`` field, and the prompt
part of a ``/v1/completions`` ``echo`` + ``logprobs`` answer (OpenAI's legacy format).

vLLM's format (``prompt_logprobs`` top-level on a chat completion, on each choice of a text
completion): a list with one entry per prompt token, ``null`` for the first, then a dict from
token id (a string: JSON keys) to ``{"logprob", "rank", "decoded_token"}`` holding the prompt
token itself (its rank in the distribution) and the ``k`` most likely tokens (ranks ``1..k``);
the prompt token is listed once when it is one of them. ``-inf`` is sent as ``-9999.0``.
"""

from __future__ import annotations

from typing import Any

from structspec.server.codec import Codec
from structspec.server.ipc import PromptLogprobEntry
from structspec.server.serving import finite, token_id_str, top_with_chosen

PromptLogprobsJSON = list[dict[str, dict[str, Any]] | None]


def prompt_logprobs_json(codec: Codec, entries: list[PromptLogprobEntry | None],
                         top_k: int) -> PromptLogprobsJSON:
    """vLLM's ``prompt_logprobs`` of one prompt (module doc), listing ``top_k`` alternatives
    per position (the engine may have scored more: an ``echo`` asked a larger ``logprobs``)."""
    out: PromptLogprobsJSON = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        tok, lp, rank, top = e
        d = {str(tok): {"logprob": finite(lp), "rank": rank,
                        "decoded_token": codec.token_str(tok)}}
        for i, (t, v) in enumerate(top[:top_k]):
            d.setdefault(str(t), {"logprob": finite(v), "rank": i + 1,
                                  "decoded_token": codec.token_str(t)})
        out.append(d)
    return out


def echo_logprobs(codec: Codec, prompt_ids: list[int],
                  entries: list[PromptLogprobEntry | None], top_k: int, *,
                  as_token_ids: bool = False) -> dict[str, Any]:
    """The prompt's part of an ``echo`` completion's ``logprobs`` (OpenAI legacy format,
    text offsets from 0): every prompt token, ``null`` logprob and top logprobs for the
    first (nothing predicts it), then each token's logprob and its ``top_k`` most likely
    alternatives (as the generated tokens list theirs). ``as_token_ids`` (vLLM's
    ``return_tokens_as_token_ids``): tokens and top keys as ``"token_id:N"``.

    ``text_offset`` indexes the echoed text: each token's offset is the length of the text
    decoded before it (an incremental detokenizer over the prompt), so a character split
    over several byte tokens (an emoji) counts once, where the tokens' own strings (``"?"``
    for each byte fragment) would count it per fragment and run past the generated text's
    first offset."""
    shown = token_id_str if as_token_ids else codec.token_str
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    pos = 0
    detok = codec.detokenizer([])
    for tok, e in zip(prompt_ids, entries, strict=True):
        tokens.append(shown(tok))
        offsets.append(pos)
        pos += len(detok.add([tok]))
        if e is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(finite(e[1]))
        tops.append(top_with_chosen(shown, tok, e[1], e[3][:top_k]))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects as one (each list of ``head`` then ``tail``'s)."""
    return {k: head[k] + tail[k] for k in ("tokens", "token_logprobs", "top_logprobs",
                                           "text_offset")}
