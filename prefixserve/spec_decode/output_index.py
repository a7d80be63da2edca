"""A bounded index of recent outputs, for suffix drafts across requests (one per tenant).

Every n-gram (``min_n <= n <= max_n``) of a remembered output maps to where it last occurred and
what followed it; a lookup takes the longest n-gram that ends the querying sequence and returns
the tokens that followed it in that output::

    remembered output 7:   call tool(a=1) ; call tool(a=2) ;
    query tail:            ... ; call tool(        -> drafts "a = 2 ) ;" (longest match)

Bounds: at most ``max_outputs`` outputs and ``max_bytes`` bytes (``nbytes``: an estimate of what
the outputs and their n-gram entries hold, ``BYTES_PER_TOKEN`` plus ``BYTES_PER_NGRAM`` per entry);
the oldest output is forgotten first, with its n-grams (an n-gram that a newer output also holds
keeps pointing at the newer one). An output larger than ``max_bytes`` on its own is not indexed.
``forget_oldest`` lets an owner of several indexes (``tenant_indexes.py``) apply a bound across
them.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

BYTES_PER_TOKEN = 8  # a slot of the output's tuple (small ints are shared)
BYTES_PER_NGRAM = 200  # a dict entry: its key tuple, its value tuple, the table slot


class OutputIndex:
    def __init__(self, max_outputs: int, min_n: int, max_n: int, max_bytes: int) -> None:
        self.max_outputs = max_outputs
        self.min_n = min_n
        self.max_n = max_n
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._outputs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._ngrams: dict[tuple[int, ...], tuple[int, int]] = {}  # -> (output id, next position)
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, token_ids: Sequence[int]) -> None:
        """Remember one output (forgetting the oldest past a bound)."""
        tokens = tuple(token_ids)
        size = self._size(tokens)
        if len(tokens) <= self.min_n or size > self.max_bytes:
            return
        output_id = next(self._ids)
        self._outputs[output_id] = tokens
        self.nbytes += size
        for start, n in self._ngram_spans(tokens):
            self._ngrams[tokens[start : start + n]] = (output_id, start + n)
        while len(self._outputs) > self.max_outputs or self.nbytes > self.max_bytes:
            self.forget_oldest()

    def forget_oldest(self) -> int:
        """Forget the oldest output and its n-grams; the bytes freed."""
        old_id, old = self._outputs.popitem(last=False)
        size = self._size(old)
        self.nbytes -= size
        for start, n in self._ngram_spans(old):
            key = old[start : start + n]
            if self._ngrams.get(key, (None,))[0] == old_id:
                del self._ngrams[key]
        return size

    def lookup(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(length of the longest matching n-gram ending ``tail``, up to ``k`` tokens that
        followed it), or (0, []) without a match."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            hit = self._ngrams.get(tuple(tail[len(tail) - n :]))
            if hit is not None:
                output_id, position = hit
                return n, list(self._outputs[output_id][position : position + k])
        return 0, []

    def _size(self, tokens: tuple[int, ...]) -> int:
        """Bytes ``tokens`` hold once indexed (see the module doc)."""
        spans = sum(1 for _ in self._ngram_spans(tokens))
        return BYTES_PER_TOKEN * len(tokens) + BYTES_PER_NGRAM * spans

    def _ngram_spans(self, tokens: tuple[int, ...]):
        """(start, n) of every n-gram with a known continuation, in order of position."""
        for start in range(len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if start + n < len(tokens):
                    yield start, n
