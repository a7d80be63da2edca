"""``--router ray-prefix``: Ray's ``PrefixCacheAffinityRouter``, unchanged, registered for the
ingress's metrics; the baseline the prefix router is measured against.

It matches the text of the prompts it routed (``EngineRequest.prompt``: one character per token)
in a prefix tree, with no feedback from the engines: it does not see evictions. Imported from its
defining module, since the public alias ``ray.serve.llm.request_router`` needs vLLM or SGLang.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)

from prefixserve.scale_out.ray_router import ReportingRouter


class MeasuredPrefixCacheAffinityRouter(ReportingRouter, PrefixCacheAffinityRouter):
    reason = "ray-prefix"

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self._register()
