"""The segment boundary finder's own decisions (``prefixserve.kv.segment_bounds``): a boundary
after every break token, pieces shorter than the minimum dropped, content-defined cuts inside
long runs that land on the same tokens wherever the run sits, and which vocabulary entries are
break tokens."""

from __future__ import annotations

import random

from prefixserve.kv.segment_bounds import break_token_ids, segment_bounds

NL = 1  # the break token in these tests


def test_break_tokens_are_whitespace_holding_a_newline():
    vocab = [(0, "\n"), (1, "\n\n"), (2, " \n "), (3, " "), (4, "a\n"), (5, ""), (6, "\t")]
    assert break_token_ids(vocab) == frozenset({0, 1, 2})


def test_a_boundary_follows_every_break_and_short_pieces_are_dropped():
    tokens = [7] * 5 + [NL] + [8] * 10 + [NL] + [9] * 3 + [NL] + [5] * 12
    bounds = segment_bounds(tokens, 0, len(tokens), frozenset({NL}), 4, 100)
    assert bounds == [(0, 6), (6, 17), (17, 21), (21, 33)]
    assert segment_bounds(tokens, 0, len(tokens), frozenset({NL}), 5, 100) == [
        (0, 6), (6, 17), (21, 33)
    ]  # fmt: skip


def test_the_minimum_counts_the_break_token():
    tokens = [9] * 3 + [NL] + [5] * 6
    assert segment_bounds(tokens, 0, len(tokens), frozenset({NL}), 4, 100) == [(0, 4), (4, 10)]
    assert segment_bounds(tokens, 0, len(tokens), frozenset({NL}), 5, 100) == [(4, 10)]


def test_bounds_start_and_end_where_asked():
    tokens = [3] * 8 + [NL] + [4] * 8 + [NL] + [6] * 8
    assert segment_bounds(tokens, 5, 20, frozenset({NL}), 2, 100) == [(5, 9), (9, 18), (18, 20)]


def test_content_cuts_are_the_same_wherever_a_long_run_sits():
    rng = random.Random(0)
    doc = [rng.randrange(2, 50_000) for _ in range(2000)]
    alone = segment_bounds(doc, 0, len(doc), frozenset(), 32, 256)
    assert len(alone) > 8 and all(b - a >= 32 for a, b in alone)
    assert alone[0][0] == 0 and alone[-1][1] == len(doc)
    for prefix in ([NL], [5, 6, NL], [9] * 40 + [NL]):
        placed = prefix + doc + [NL] + [3] * 40
        offset = len(prefix)
        shifted = segment_bounds(placed, 0, len(placed), frozenset({NL}), 32, 256)
        inside = [(a - offset, b - offset) for a, b in shifted if offset <= a < offset + 2000]
        assert inside[:-1] == alone[:-1]
        assert inside[-1] == (alone[-1][0], alone[-1][1] + 1)  # the break after the run joins it


def test_a_run_embedded_without_a_break_resynchronizes_after_its_first_cut():
    rng = random.Random(1)
    doc = [rng.randrange(2, 50_000) for _ in range(2000)]
    alone = {tuple(doc[a:b]) for a, b in segment_bounds(doc, 0, len(doc), frozenset(), 32, 256)}
    glued = [rng.randrange(2, 50_000) for _ in range(77)] + doc
    pieces = segment_bounds(glued, 0, len(glued), frozenset(), 32, 256)
    found = {tuple(glued[a:b]) for a, b in pieces}
    assert len(alone & found) >= len(alone) - 2  # all but the piece where the run begins
