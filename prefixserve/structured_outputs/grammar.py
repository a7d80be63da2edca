"""One sequence's place in a compiled grammar (``Grammar``), and the batched bitmask helpers.

One decoding step, for the rows of a batch whose sequences are constrained::

    bitmask = allocate_bitmask(max_num_rows, vocab_size)   # int32, CPU; allocate once
    grammar.fill_bitmask(bitmask, row)                     # each constrained row (CPU work)
    apply_bitmask(logits, bitmask, rows)                   # disallowed tokens -> -inf, in place,
                                                           # before penalties/temperature/top-p
    token = sample(logits[row])
    grammar.accept_token(token)                            # True for any token the mask allowed

Bitmask row ``i`` masks logits row ``i``; rows not in ``rows`` are left untouched, so a batch can
mix constrained and free requests. Bit ``j`` of a row set means token ``j`` is allowed. The
bitmask spans the model's vocab (the logits width), so ids past the tokenizer's vocab are masked.

EOS: the model's stop tokens are allowed exactly when the text so far is a complete match (with
other tokens too if the grammar can also go on); once one is accepted, ``is_terminated()`` is
True and the sequence is done. Special tokens (BOS, ``<|im_start|>``, ...) are never allowed: the
detokenizer drops them, so they are no part of the text the grammar checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr


class Grammar:
    """A per-sequence matcher over one compiled grammar (wraps ``xgrammar.GrammarMatcher``).

    Not thread-safe: the engine thread owns it. Forked with its sequence (n > 1, beam search) and
    kept across preemption; its state is exactly the tokens accepted so far.
    """

    __slots__ = ("_decoded_vocab", "_tokenizer", "matcher")

    def __init__(
        self, matcher: xgr.GrammarMatcher, decoded_vocab: Sequence[bytes], tokenizer: Any
    ) -> None:
        self.matcher = matcher
        self._decoded_vocab = decoded_vocab  # token id -> bytes it writes (b"" for special ids)
        self._tokenizer = tokenizer  # encodes jump-forward text

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False, with the state unchanged, if the grammar forbids it."""
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted: the output is complete."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, CPU).

        Returns False when every token is allowed (applying the row would change nothing).
        Must not be called once terminated (xgrammar raises).
        """
        return self.matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> Grammar:
        """An independent copy at the same state (the compiled grammar is shared)."""
        return Grammar(self.matcher.fork(), self._decoded_vocab, self._tokenizer)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (at most as many as were accepted)."""
        self.matcher.rollback(num_tokens)

    def jump_forward_string(self) -> str:
        """The longest text the grammar forces next, whatever the model would say ("" if none).

        Whole UTF-8 characters only; it never includes a stop token. The state is unchanged.
        """
        return self.matcher.find_jump_forward_string()

    def jump_forward_tokens(self) -> list[int]:
        """The forced text as the tokenizer encodes it, or [] when that is not safe to append.

        Safe means both: the tokens write exactly the forced bytes (checked against the vocab as
        xgrammar decodes it, so a SentencePiece "▁" prefix space is caught), and the matcher
        accepts them one by one. Then appending them and calling ``accept_token`` on each keeps
        the output valid. It is still a tokenization the model did not choose: the forced text
        alone is encoded, so at its edges the split can differ from what the tokenizer makes of
        the whole text (e.g. ``"`` merged with the model's next word). The state is unchanged.
        """
        text = self.jump_forward_string()
        if not text:
            return []
        token_ids = self._tokenizer.encode(text, add_special_tokens=False)
        vocab = self._decoded_vocab
        if any(t >= len(vocab) for t in token_ids):
            return []
        if b"".join(vocab[t] for t in token_ids) != text.encode():
            return []
        probe = self.matcher.fork()
        if not all(probe.accept_token(t) for t in token_ids):
            return []
        return token_ids


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An int32 CPU bitmask of shape (num_rows, ceil(vocab_size / 32)), every token allowed.

    ``vocab_size`` is the logits width (the model's vocab, which can exceed the tokenizer's).
    """
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None
) -> None:
    """Set ``logits[r, j]`` to -inf where bit j of ``bitmask[r]`` is 0, for r in ``rows`` (or all).

    ``logits`` is (num_rows, vocab) float32/bfloat16/float16 on any device; the bitmask is copied
    to that device first. On CPU xgrammar runs its C++ kernel, on CUDA its Triton kernel.
    """
    assert bitmask.shape[-1] * 32 >= logits.shape[-1], "bitmask narrower than the logits"
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
