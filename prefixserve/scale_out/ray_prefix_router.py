"""``--router ray-prefix``: Ray's ``PrefixCacheAffinityRouter``, unchanged, counted for the
ingress's metrics; the baseline the prefix router is measured against.

It matches the text of the prompts it routed (``EngineRequest.prompt``: one character per token)
in a prefix tree, with no feedback from the engines: it does not see evictions. Its own module,
imported only for this router, because Ray's class lives in ``ray.llm`` (``ray_private``).
"""

from __future__ import annotations

from prefixserve.scale_out.ray_private import prefix_cache_affinity_router
from prefixserve.scale_out.reporting_router import ReportingRouter


class MeasuredPrefixCacheAffinityRouter(ReportingRouter, prefix_cache_affinity_router()):
    reason = "ray-prefix"
