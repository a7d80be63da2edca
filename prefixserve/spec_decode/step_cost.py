"""What one more row costs a step, measured: the price a draft token makes the whole batch pay.

A forward's time is close to affine in its rows, ``t(R) = a + b R``: ``a`` reads the weights (a
decode step on CPU is bound by it), ``b`` is each row's arithmetic. ``StepCost`` fits ``a`` and
``b`` by least squares over the last ``window`` steps (rows, seconds). A draft adds one row to a
step of ``R`` rows and costs every sequence in it ``b``; what it buys, when accepted, is a token,
worth the step's time per row ``t(R) / R``. ``row_price(R)`` is their ratio, ``b R / t(R)``: near
0 where weights dominate (one stream), growing with the batch.

Until the steps seen span at least two row counts (the fit is undetermined) ``row_price`` is
None: the proposer then drafts as if rows were free, and its verify steps supply the spread.

``FixedStepCost`` prices every row the same and ignores the steps' times
(``speculative_config.draft_row_price``): drafting then does not depend on timing.
"""

from __future__ import annotations

from collections import deque


class StepCost:
    def __init__(self, window: int = 64) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self._steps.append((rows, seconds))

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` of ``t(R) = a + b R`` (``b`` at least 0), or None without two row counts."""
        n = len(self._steps)
        if n < 2:
            return None
        mean_r = sum(r for r, _ in self._steps) / n
        mean_t = sum(t for _, t in self._steps) / n
        var = sum((r - mean_r) ** 2 for r, _ in self._steps)
        if var == 0:
            return None
        b = max(0.0, sum((r - mean_r) * (t - mean_t) for r, t in self._steps) / var)
        return mean_t - b * mean_r, b

    def row_price(self, rows: int) -> float | None:
        """What one more row in a step of ``rows`` costs, in tokens of that step (see above)."""
        fit = self.fit()
        if fit is None:
            return None
        a, b = fit
        total = a + b * rows
        return b * rows / total if total > 0 else None


class FixedStepCost:
    """``StepCost``'s interface with a fixed ``row_price``; the steps observed change nothing."""

    def __init__(self, price: float) -> None:
        self.price = price

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def row_price(self, rows: int) -> float:
        return self.price
