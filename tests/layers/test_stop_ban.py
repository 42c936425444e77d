"""ban_stop_tokens_ against a plain per-row loop: the banned requests' stop ids are -inf at
the rows whose depth is below their ``min_tokens`` gap, except in a row the ban would leave
with no finite logit; other rows and requests are untouched."""

from __future__ import annotations

import torch

from structspec.layers.stop_ban import StopBan, ban_stop_tokens_


def _reference(logits: torch.Tensor, depth: torch.Tensor, bans: dict[int, tuple[int, list[int]]]
               ) -> torch.Tensor:
    out = logits.clone()
    n = depth.shape[1]
    for b, (until, ids) in bans.items():
        for i in range(n):
            if depth[b, i] >= until:
                continue
            row = out[b * n + i].clone()
            row[ids] = float("-inf")
            if torch.isfinite(row.max()):
                out[b * n + i] = row
    return out


def test_ban_matches_the_row_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    bsz, n, vocab = 4, 5, 40
    logits = torch.randn(bsz * n, vocab, generator=gen)
    depth = torch.tensor([[0, 1, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 2, 2], [0, 1, 1, 1, 1]])
    # request 1 row 2: only its stop ids allowed (a complete grammar); request 2 row 1: NaN
    logits[1 * n + 2] = float("-inf")
    logits[1 * n + 2, [7, 9]] = 0.5
    logits[2 * n + 1, 3] = float("nan")
    bans = {1: (3, [7, 9]), 2: (2, [3, 11, 12]), 3: (1, [0])}
    width = max(len(ids) for _, ids in bans.values())
    ban = StopBan(requests=torch.tensor(list(bans)),
                  until=torch.tensor([u for u, _ in bans.values()]),
                  tokens=torch.tensor([ids + [ids[0]] * (width - len(ids))
                                       for _, ids in bans.values()]))
    want = _reference(logits, depth, bans)
    got = logits.clone()
    ban_stop_tokens_(got, depth, ban)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.equal(got[:n], logits[:n])  # request 0 has no ban
    assert torch.isneginf(got[1 * n + 1, [7, 9]]).all()  # depth 1 < 3: banned
    assert torch.isfinite(got[1 * n + 2, [7, 9]]).all()  # only stop ids left: kept
    assert torch.isfinite(got[1 * n + 3, [7, 9]]).all()  # depth 3: past min_tokens
