"""Load or recompute: measured per block, so a tier is used only where loading is cheaper.

Recomputing a block costs ``block_size`` prompt tokens of a forward: ``observe_forward`` feeds
the engine's prefill-sized steps (at least ``MIN_TOKENS`` tokens: decode steps cost more per
token and would flatter the tiers). Loading a block costs what the tier worker measures: the
read, the checks and the decode, per block. Both are exponential moving averages; until both
are measured, loading is assumed to pay (the first loads measure it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.2
MIN_TOKENS = 64


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class LoadCost:
    block_size: int
    recompute_s_per_token: float | None = None
    load_s_per_block: dict[str, float] = field(default_factory=dict)

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_TOKENS and seconds > 0:
            self.recompute_s_per_token = _ema(self.recompute_s_per_token, seconds / num_tokens)

    def observe_load(self, medium: str, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self.load_s_per_block[medium] = _ema(
                self.load_s_per_block.get(medium), seconds / num_blocks
            )

    def worth_loading(self, medium: str) -> bool:
        """Whether loading one block from ``medium`` is cheaper than recomputing it."""
        load = self.load_s_per_block.get(medium)
        if load is None or self.recompute_s_per_token is None:
            return True
        return load < self.recompute_s_per_token * self.block_size

    def snapshot(self) -> dict[str, float | None]:
        recompute = self.recompute_s_per_token
        return {
            "recompute_s_per_block": None if recompute is None else recompute * self.block_size,
            **{f"load_s_per_block_{m}": s for m, s in self.load_s_per_block.items()},
        }
