"""Every use of Ray's private modules and attributes, in one place.

Written against ray[serve] 2.60.0 (pyproject pins ``ray[serve]>=2.60,<3``); these names are not
Ray's public API and may move in any release, so a Ray upgrade starts by checking this file
(``tests/test_scale_out_ray.py`` exercises each of them against a live local cluster):

- ``PowerOfTwoChoicesRequestRouter``: Serve's default router, the ``pow2`` baseline; public
  only by its import path string.
- ``PrefixCacheAffinityRouter`` (``ray.llm._internal``): the ``ray-prefix`` baseline; its public
  alias ``ray.serve.llm.request_router`` needs vLLM or SGLang, so it is imported from its
  defining module, and only when asked for.
- ``request_router_of``: the request router a ``DeploymentHandle`` built in this process. Ray
  builds it from the pickled class and kwargs of ``RequestRouterConfig``, so no constructor
  argument of ours reaches it; the handle that owns it is the one thing the ingress holds.
- ``own_request_id``: Serve's request context (``ray.serve.context``), emptied so that a call
  gets an internal request id of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ray.serve import context as serve_context
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.handle import DeploymentHandle


def prefix_cache_affinity_router() -> type:
    """Ray's ``PrefixCacheAffinityRouter`` class (imports ``ray.llm`` on first use)."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    return PrefixCacheAffinityRouter


def request_router_of(handle: DeploymentHandle) -> Any | None:
    """The ``RequestRouter`` that ``handle`` routes with in this process, or None before the
    handle's first call built it. Reads, never builds: safe from any thread."""
    router = handle._router  # SingletonThreadRouter or CurrentLoopRouter, once initialized
    if router is None:
        return None
    return router._asyncio_router._request_router


@contextmanager
def own_request_id() -> Iterator[None]:
    """Handle calls made inside get an internal request id of their own, not the id of the
    request being served. Serve gives a replica chosen for one pending call to the pending call
    with the same id (``RequestRouter._fulfill_next_pending_request``), so two calls of one
    request in flight at once, each pinned to its own replica, could otherwise swap replicas."""
    token = serve_context._serve_request_context.set(serve_context._RequestContext())
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


__all__ = [
    "PowerOfTwoChoicesRequestRouter",
    "own_request_id",
    "prefix_cache_affinity_router",
    "request_router_of",
]
