"""Test helper: an async test function run to completion, each call on its own event loop."""

from __future__ import annotations

import asyncio
import functools


def run(test):
    """``test`` (an async function) as a plain test that runs it on a fresh event loop."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper
