"""Counters of speculative decoding (monotonic), read through ``LLMEngine.stats()``.

``num_drafts``: verifications with at least one draft token; ``num_draft_tokens``: draft tokens
scored; ``num_accepted_tokens``: drafts the verifier kept. ``acceptance_rate`` = accepted / draft
tokens; ``mean_acceptance_length`` = 1 + accepted / drafts, the tokens one speculating step emits
on average (the bonus or correction token included), as vLLM reports it.
"""

from __future__ import annotations


class SpecDecodeStats:
    def __init__(self, method: str) -> None:
        self.method = method
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        assert 0 <= num_accepted <= num_drafts
        if num_drafts:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted

    def snapshot(self) -> dict[str, float | int | str]:
        drafts, tokens, accepted = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {
            "method": self.method,
            "num_drafts": drafts,
            "num_draft_tokens": tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
        }
