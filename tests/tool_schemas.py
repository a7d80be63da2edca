"""The tools and argument schemas the structured-output server tests force calls of: bounded
strings and integers, so a random-weight model's grammar-constrained call always ends."""

from __future__ import annotations


def city_schema(max_city_len: int) -> dict:
    return {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": max_city_len},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    }


ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


def weather_and_add_tools(city: dict) -> list[dict]:
    """Chat-completions tools ``get_weather(city, days)`` (schema ``city``) and ``add(a, b)``."""
    return [
        {"type": "function", "function": {"name": "get_weather", "parameters": city}},
        {"type": "function", "function": {"name": "add", "parameters": ADD}},
    ]
