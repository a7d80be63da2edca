"""Prompt lookup (n-gram) drafts: continue the sequence the way it continued before.

Find the most recent earlier occurrence of the sequence's last ``n`` tokens, trying the longest
``n`` first (``max_n`` down to ``min_n``), and propose the ``k`` tokens that followed it::

    tokens   a b c d x y a b c d ? ...        last 4 tokens "a b c d" also occur at 0
    match    ^^^^^^^                           drafts: "x y a b" (k = 4), what followed them
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def match_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """(length of the matched n-gram, up to ``k`` tokens that followed it: fewer when the match
    ends early), or (0, []) without a match."""
    num_tokens = len(token_ids)
    if k <= 0 or num_tokens <= min_n:
        return 0, []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # windows[i] = tokens[i : i + n] for every start whose continuation is known (i + n < N)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return n, tokens[start : start + k].tolist()
    return 0, []
