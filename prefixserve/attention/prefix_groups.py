"""Prefix groups: sequences of one step whose block tables start with the same physical blocks.

Requests that hit one cached system prompt, forked samples and beams hold the same leading
blocks. An attention backend may attend to a group's shared blocks once for all its members and
merge that with each member's own part (cascade attention); the torch backend does, and any
backend may. Planning is the attention layer's; the model runner only supplies block tables.
"""

from __future__ import annotations

# Sequences sharing at least this many leading tokens of KV attend to them once, as a group.
MIN_SHARED_PREFIX_TOKENS = 64


def plan_prefix_groups(
    tables: list[list[int]], context_starts: list[int], block_size: int
) -> list[tuple[list[int], int]]:
    """Group the batch's sequences whose block tables start with the same blocks.

    A group's shared blocks lie wholly before every member's first query token
    (``context_starts``), so each member sees all of them. Sharing can nest (a preamble shared by
    all, then documents shared within sets): ``_split_group`` picks the grouping that reads the
    fewest KV blocks per member. Groups of one are dropped.
    """
    min_blocks = -(-MIN_SHARED_PREFIX_TOKENS // block_size)
    limits = [c // block_size for c in context_starts]
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if limits[i] >= min_blocks:  # a member still computing the shared blocks cannot join
            by_first.setdefault(table[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) >= 2:
            groups.extend(_split_group(members, tables, limits, 1))
    return [(members, shared) for members, shared in groups if shared >= min_blocks]


def _split_group(
    members: list[int], tables: list[list[int]], limits: list[int], depth: int
) -> list[tuple[list[int], int]]:
    """Members share their first ``depth`` blocks; extend that, or split where they diverge."""
    limit = min(limits[i] for i in members)
    ref = tables[members[0]]
    shared = depth
    while shared < limit and all(tables[i][shared] == ref[shared] for i in members):
        shared += 1
    if shared == limit:
        return [(members, shared)]
    by_next: dict[int, list[int]] = {}
    for i in members:
        by_next.setdefault(tables[i][shared], []).append(i)
    subgroups = [
        g
        for sub in by_next.values()
        if len(sub) >= 2
        for g in _split_group(sub, tables, limits, shared + 1)
    ]
    # KV blocks read per step: the shared blocks once per group, the rest once per member.
    keep_cost = shared + sum(limits[i] - shared for i in members)
    grouped = {i for sub, _ in subgroups for i in sub}
    split_cost = sum(k + sum(limits[i] - k for i in sub) for sub, k in subgroups)
    split_cost += sum(limits[i] for i in members if i not in grouped)
    return subgroups if split_cost < keep_cost else [(members, shared)]
