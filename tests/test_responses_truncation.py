"""``truncation: "auto"`` without a server: where a conversation may be cut, what is kept, and
that the fewest turns are dropped (a renderer that counts words stands in for the template)."""

from __future__ import annotations

from prefixserve.api.openai.responses.items import normalize_input
from prefixserve.api.openai.responses.truncation import cuts, kept, truncate

ITEMS = normalize_input([
    {"role": "system", "content": "rules"},                                          # 0
    {"role": "user", "content": "a " * 10},                                          # 1
    {"role": "assistant", "content": "b " * 10},                                     # 2
    {"role": "developer", "content": "more rules"},                                  # 3
    {"role": "user", "content": "c " * 10},                                          # 4
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},      # 5
    {"type": "function_call_output", "call_id": "c1", "output": "d " * 10},          # 6
    {"role": "user", "content": "e " * 10},                                          # 7
])  # fmt: skip


def words(items: list[dict]) -> int:
    total = 0
    for item in items:
        value = item.get("content", item.get("output", item.get("arguments")))
        parts = value if isinstance(value, list) else [{"text": value}]
        total += sum(len(p["text"].split()) for p in parts)
    return total


def test_cuts_fall_only_where_a_user_turn_starts():
    assert cuts(ITEMS) == [4, 7]  # item 1 is the first turn: cutting there drops nothing
    assert cuts(ITEMS[:1]) == [] and cuts(ITEMS[1:4]) == [] and cuts(ITEMS[3:5]) == []


def test_system_and_developer_items_before_the_cut_are_kept():
    assert [i["id"] for i in kept(ITEMS, 4)] == [ITEMS[k]["id"] for k in (0, 3, 4, 5, 6, 7)]
    assert [i["id"] for i in kept(ITEMS, 7)] == [ITEMS[k]["id"] for k in (0, 3, 7)]


def test_the_fewest_turns_are_dropped():
    renders = []

    def render(items):
        renders.append(len(items))
        return words(items)

    assert words(ITEMS) == 54
    prompt, items = truncate(ITEMS, render, lambda n: n <= 40)  # dropping turn 1 is enough
    assert prompt == 34 and items == kept(ITEMS, 4)
    prompt, items = truncate(ITEMS, render, lambda n: n <= 20)
    assert prompt == 13 and items == kept(ITEMS, 7)
    assert len(renders) == 1 + 2  # a binary search over the two cuts: 1, then 2 renders


def test_nothing_fits_gives_the_last_cut_and_no_cut_gives_none():
    prompt, items = truncate(ITEMS, words, lambda n: n <= 5)
    assert items == kept(ITEMS, 7) and prompt == 13  # the engine refuses it with the context 400
    assert truncate(ITEMS[:3], words, lambda n: n <= 5) is None
