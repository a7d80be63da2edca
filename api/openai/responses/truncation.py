"""``truncation: "auto"``: a conversation over the context window loses its oldest turns.

OpenAI's rule: when the input exceeds the context window, items are dropped from the start of
the conversation until it fits. Here, precisely::

    items:  [sys] [user ...] [asst ...] [sys] [user ...] [fc] [fco] [user ...]
    cuts:          ^0                          ^1                     ^2
    kept at cut 1: [sys]                [sys] [user ...] [fc] [fco] [user ...]

- a cut falls only where a user ``message`` starts a turn (never inside a turn, so a function
  call keeps its output, and the template still sees a conversation that opens with a user);
- system and developer messages before the cut are kept (instructions never are items: they are
  always kept);
- the fewest turns are dropped: the first cut whose rendering fits (a binary search over the
  cuts, since dropping more never makes a prompt longer);
- if even the last cut does not fit, that rendering is returned, and the engine refuses it with
  the context-length 400, as it would without truncation.

A truncated prompt is always a full rendering of the kept items (never a splice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

P = TypeVar("P")
_SYSTEM = ("system", "developer")


def _is_system(item: dict[str, Any]) -> bool:
    return item["type"] == "message" and item.get("role") in _SYSTEM


def cuts(items: list[dict[str, Any]]) -> list[int]:
    """Indexes where a cut may fall: user messages after the first item that is not a system
    message (a cut must drop something)."""
    first = next((i for i, item in enumerate(items) if not _is_system(item)), len(items))
    return [
        i for i, item in enumerate(items)
        if i > first and item["type"] == "message" and item.get("role") == "user"
    ]  # fmt: skip


def kept(items: list[dict[str, Any]], cut: int) -> list[dict[str, Any]]:
    """The items left by cutting at ``cut``: the system messages before it, then the rest."""
    return [item for item in items[:cut] if _is_system(item)] + items[cut:]


def truncate(
    items: list[dict[str, Any]],
    render: Callable[[list[dict[str, Any]]], P],
    fits: Callable[[P], bool],
) -> tuple[P, list[dict[str, Any]]] | None:
    """(prompt, kept items) of the first cut whose rendering fits, or of the last cut when none
    does; None when there is no cut (nothing can be dropped)."""
    points = cuts(items)
    if not points:
        return None
    lo, hi = 0, len(points) - 1
    best: tuple[P, list[dict[str, Any]]] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = kept(items, points[mid])
        prompt = render(candidate)
        if fits(prompt):
            best, hi = (prompt, candidate), mid - 1
        else:
            lo = mid + 1
    if best is None:
        last = kept(items, points[-1])
        return render(last), last
    return best
