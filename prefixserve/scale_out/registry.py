"""Where the ingress finds the engine deployment's request router in its own process.

Ray, not the ingress, constructs a deployment handle's router, so the router registers itself
here (``ray_router.ReportingRouter``) and the ingress's cluster view looks it up by deployment.
This is the one piece of process-wide state of the scale-out code. It lives in its own module
because Ray pickles a router class together with its own module (by value): state kept there
would be a private copy in the process that unpickles it.
"""

from __future__ import annotations

import weakref
from typing import Any

_routers: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()


def register(app_name: str, deployment_name: str, router: Any) -> None:
    _routers[(app_name, deployment_name)] = router


def router_for(app_name: str, deployment_name: str) -> Any | None:
    """The router of that deployment in this process, once a handle call created it."""
    return _routers.get((app_name, deployment_name))
