"""Scale-out: prefixserve on Ray Serve, one ingress and N engine replicas, routed by prefix.

Modules (Ray is imported by ``ray_private``, ``ray_router``, ``ray_prefix_router``,
``deployments`` and inside ``launcher`` only; Ray's private names by ``ray_private`` alone)::

    protocol.py           what the ingress, replicas and router exchange
    router.py             prefix-aware routing as plain Python: HashMirror, choose(), the state
    event_follower.py     a thread per replica keeping its HashMirror in step with its KV events
    reporting_router.py   the mixin of every router: replica reports, requests by reason
    ray_private.py        Ray's private names (pinned version): pow2, ray-prefix, a handle's router
    ray_router.py         the Ray Serve RequestRouters: prefix (ours) and pow2 (Ray's default)
    ray_prefix_router.py  Ray's PrefixCacheAffinityRouter, as the ray-prefix baseline
    remote_engine.py      AsyncEngine's interface over the replicas, for the ingress's handlers
    cluster.py            the ingress's /metrics, /stats and /dashboard over every replica
    deployments.py        the Serve application: Ingress + EngineReplica
    launcher.py           ``prefixserve serve --replicas N``: start or join Ray, run, drain, stop
"""
