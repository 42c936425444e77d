"""Multi-token ``bad_words``: a word's last token banned at each verify-tree row whose path
ends with the word's other tokens, exact per row, on the device, no host sync.

vLLM v1 (``vllm/v1/sample/ops/bad_words.py``, ``apply_bad_words`` and, under speculation,
``apply_bad_words_with_drafts``) sets ``logits[last] = -inf`` at a position when the tokens
before it end with the word's prefix; the tokens before a position are the request's *output*
tokens (not the prompt) followed by the draft tokens before it. Here row ``(b, i)`` of a verify
tree predicts output position ``len(output) + depth(i)``; the tokens before it are the committed
output followed by the draft tokens of the nodes on the path root..i below the root (node 0,
the root, is the last committed token). Each row's last ``L`` such tokens are gathered by
following parent links on the device, compared with every word's prefix, and the matching
words' last tokens are set to -inf in that row. Greedy output with speculation therefore equals
greedy output without it, and sampling stays exact.

One-token words are not here: they are banned at every position through the penalty table
(:mod:`structspec.scheduler.penalty_slots`).

This ban runs after the grammar mask. A row it would leave without a finite logit (the grammar
allows nothing but the word's last token there) keeps its logits: the grammar goes first, as
with ``min_tokens`` (:mod:`structspec.layers.stop_ban`). Failing the request instead would not
be exact under speculation: such a row may lie off the path the target accepts. Without a
grammar no row is emptied this way (it would take every other token to be banned too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: a word-prefix entry that matches any token (the prefix is shorter than the context)
ANY_TOKEN = -2
#: a context entry with no token (the output is shorter than the context): matches no word
NO_TOKEN = -1


@dataclass(frozen=True)
class WordBan:
    """The multi-token bad words of a batch's requests, for one step (host-built, on the
    model device).

    ``K`` words belong to ``M`` requests; the words of one request that end with the same
    token form one group (``G`` groups), so that each (group, row) is one distinct logit.

    Attributes:
        requests: int64 ``[M]`` batch indices of the requests.
        committed: int64 ``[M, L]`` each request's last ``L`` output tokens, oldest first,
            left-padded with :data:`NO_TOKEN` when its output is shorter.
        prefixes: int64 ``[K, L]`` each word without its last token, right-aligned,
            left-padded with :data:`ANY_TOKEN`.
        word_group: int64 ``[K]`` the group of each word.
        group_request: int64 ``[G]`` each group's request, an index into ``requests``.
        group_token: int64 ``[G]`` each group's banned (last) token.
    """

    requests: torch.Tensor
    committed: torch.Tensor
    prefixes: torch.Tensor
    word_group: torch.Tensor
    group_request: torch.Tensor
    group_token: torch.Tensor

    @staticmethod
    def build(entries: Sequence[tuple[int, Sequence[int], Sequence[Sequence[int]]]],
              to_device: Callable[[torch.Tensor], torch.Tensor]) -> WordBan:
        """A step's ban from its requests' ``(batch index, output ids, words)``, every word
        at least two tokens long, staged in one host-to-device copy.

        Args:
            entries: one per request with multi-token words (at least one).
            to_device: a host int64 tensor -> the same on the model device.
        """
        ell = max(len(w) - 1 for _, _, words in entries for w in words)
        requests, committed, prefixes, word_group, group_request, group_token = ([] for _ in
                                                                                 range(6))
        for m, (b, output, words) in enumerate(entries):
            requests.append(b)
            tail = list(output[-ell:])
            committed.extend([NO_TOKEN] * (ell - len(tail)) + tail)
            groups: dict[int, int] = {}
            for w in words:
                if w[-1] not in groups:
                    groups[w[-1]] = len(group_token)
                    group_request.append(m)
                    group_token.append(w[-1])
                word_group.append(groups[w[-1]])
                prefixes.extend([ANY_TOKEN] * (ell - len(w) + 1) + list(w[:-1]))
        parts = [requests, committed, prefixes, word_group, group_request, group_token]
        flat = to_device(torch.tensor([t for p in parts for t in p], dtype=torch.int64))
        req, com, pre, wg, gr, gt = flat.split([len(p) for p in parts])
        return WordBan(requests=req, committed=com.view(-1, ell), prefixes=pre.view(-1, ell),
                       word_group=wg, group_request=gr, group_token=gt)


def row_contexts(committed: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                 depth: torch.Tensor) -> torch.Tensor:
    """The last ``L`` tokens before each row's predicted position.

    Args:
        committed: int64 ``[M, L]`` (as :attr:`WordBan.committed`).
        draft_tokens, parents, depth: int64 ``[M, N]`` the requests' tree fields (see
            :class:`~structspec.draft_tree.layout.VerifyTree`), on the same device.

    Returns:
        int64 ``[M, N, L]``, oldest first: row i's path tokens below the root (the nearest
        last), preceded by the committed output; :data:`NO_TOKEN` where there is none.
    """
    m, n = draft_tokens.shape
    ell = committed.shape[1]
    node = torch.arange(n, device=draft_tokens.device).expand(m, n)
    out = []
    for r in range(ell):  # r tokens back from the row's own position, minus one
        # depth(i) > r: the token is the draft token of row i's ancestor r levels up (the
        # root's token is the committed output's last); else committed[-(r - depth + 1)]
        in_tree = depth > r
        tree_tok = draft_tokens.gather(1, node)
        back = (ell - 1 - (r - depth)).clamp(0, ell - 1)
        out.append(torch.where(in_tree, tree_tok, committed.gather(1, back)))
        node = torch.where(in_tree, parents.gather(1, node).clamp(min=0), node)
    out.reverse()
    return torch.stack(out, dim=2)


def ban_bad_words_(logits: torch.Tensor, draft_tokens: torch.Tensor, parents: torch.Tensor,
                   depth: torch.Tensor, ban: WordBan) -> None:
    """Set each row's matching multi-token bad words' last tokens to -inf, unless that leaves
    the row nothing to choose (see the module doc). In place; no host sync.

    Args:
        logits: ``[B * N, V]`` float32 on the device, after the grammar mask (row
            ``b * N + i`` = node i of request b).
        draft_tokens, parents, depth: int64 ``[B, N]`` the verify tree's fields, on the
            device.
        ban: the step's words (built by the scheduler's selection phase).
    """
    n = draft_tokens.shape[1]
    req = ban.requests
    ctx = row_contexts(ban.committed, draft_tokens.index_select(0, req),
                       parents.index_select(0, req), depth.index_select(0, req))  # [M, N, L]
    word_request = ban.group_request.index_select(0, ban.word_group)
    prefixes = ban.prefixes.unsqueeze(1)  # [K, 1, L]
    match = ((prefixes == ctx.index_select(0, word_request)) | (prefixes == ANY_TOKEN)).all(2)
    # a group is hit at a row when any of its words matches there ([G, N]; the groups are
    # distinct (request, token) pairs, so each (group, row) is one logit)
    hit = torch.zeros(ban.group_token.shape[0], n, dtype=torch.int64, device=logits.device)
    hit = hit.index_add_(0, ban.word_group, match.to(torch.int64)) > 0
    rows = ((req.index_select(0, ban.group_request) * n).unsqueeze(1)
            + torch.arange(n, device=logits.device))  # [G, N]
    cols = ban.group_token.unsqueeze(1).expand_as(rows)
    before = logits[rows, cols]
    logits[rows, cols] = torch.where(hit, float("-inf"), before)
    # a row left all -inf (the grammar allows only banned tokens there) gets its values back;
    # a NaN row is restored unchanged, for select_verify to refuse
    dead = ~torch.isfinite(logits.amax(dim=1))
    logits[rows, cols] = torch.where(hit & ~dead[rows], float("-inf"), before)
