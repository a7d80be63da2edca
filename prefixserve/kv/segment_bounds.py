"""Where a prompt splits into segments whose K/V may be reused wherever they sit (``segments.py``).

A segment must come out the same wherever its text is placed, so every boundary depends on the
segment's own tokens, never on what precedes it::

    break tokens     a boundary after every token that is whitespace holding a newline ("\\n",
                     "\\n\\n", ...): documents stuffed one per line or paragraph, content parts
                     (joined with "\\n" by the chat templates) and chat turns all end there
    content-defined  inside a run longer than ``max_tokens``: a boundary after token ``i``
                     when a hash of tokens ``i - WINDOW + 1 .. i`` is 0 modulo ``CUT_MODULUS``
                     and the piece is at least ``min_tokens`` long; so a long document without
                     newlines cuts at the same interior places wherever it sits

A piece shorter than ``min_tokens`` is no segment (too short to be worth a lookup). Pure
functions over token ids; ``break_token_ids`` says which ids are break tokens for a tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

WINDOW = 4
CUT_MODULUS = 64
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def break_token_ids(tokens: Iterable[tuple[int, str]]) -> frozenset[int]:
    """The ids of ``(id, text)`` pairs whose text is whitespace holding a newline."""
    return frozenset(i for i, text in tokens if text and text.isspace() and "\n" in text)


def segment_bounds(
    token_ids: Sequence[int],
    start: int,
    end: int,
    breaks: frozenset[int],
    min_tokens: int,
    max_tokens: int,
) -> list[tuple[int, int]]:
    """The segments ``[a, b)`` of ``token_ids[start:end]``, in order (see the module doc). A
    segment ends with its break token; the piece before ``start``'s first break is one too when
    long enough (a prompt's suffix may start inside a paragraph)."""
    pieces: list[tuple[int, int]] = []
    a = start
    for i in range(start, end):
        if token_ids[i] in breaks:
            pieces.append((a, i + 1))
            a = i + 1
    if a < end:
        pieces.append((a, end))
    out: list[tuple[int, int]] = []
    for a, b in pieces:
        cuts = _content_cuts(token_ids, a, b, min_tokens) if b - a > max_tokens else []
        for lo, hi in zip([a, *cuts], [*cuts, b]):
            if hi - lo >= min_tokens:
                out.append((lo, hi))
    return out


def _content_cuts(token_ids: Sequence[int], a: int, b: int, min_tokens: int) -> list[int]:
    """Content-defined cut positions inside ``[a, b)``, each leaving ``min_tokens`` on its left."""
    cuts = []
    last = a
    for i in range(a + WINDOW - 1, b - min_tokens):
        if i + 1 - last < min_tokens:
            continue
        h = 0
        for t in token_ids[i - WINDOW + 1 : i + 1]:
            h = ((h ^ (t & _MASK)) * _MIX) & _MASK
        if (h >> 32) % CUT_MODULUS == 0:
            cuts.append(i + 1)
            last = i + 1
    return cuts
