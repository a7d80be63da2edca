"""``prefixserve serve --replicas N``: run the engine on Ray Serve until SIGTERM, then drain.

::

    start a local Ray (address "local") or join --ray-address
      ─▶ serve.start(HTTP on --host:--port) ─▶ serve.run(ingress + N engine replicas)
      ─▶ wait for SIGTERM / SIGINT
      ─▶ ingress.drain(--shutdown-grace-seconds): new requests get 503, those in flight finish
      ─▶ a local cluster: serve.shutdown() and ray.shutdown() stop every process it started;
         a joined one: this application is deleted (and Serve's own actors, if no other
         application uses them); the cluster keeps running

This module imports Ray only inside ``run_scale_out``, so ``prefixserve serve`` without
replicas never loads it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

_DRAIN_MARGIN_S = 15.0  # past the grace period: time for the ingress to abort and answer


def add_scale_out_args(parser: argparse.ArgumentParser) -> None:
    """The scale-out options of ``prefixserve serve``."""
    from prefixserve.scale_out.router import ROUTERS, RouterConfig

    group = parser.add_argument_group("scale-out (Ray Serve; needs prefixserve[ray])")
    group.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="engine replicas; above 1 (or with --ray-address) the server runs on Ray Serve",
    )
    group.add_argument(
        "--router",
        choices=ROUTERS,
        default="prefix",
        help="prefix: by the block hashes each replica holds (its KV events) against its load; "
        "pow2: Ray's power of two choices; ray-prefix: Ray's PrefixCacheAffinityRouter",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster ('auto': the one 'ray start --head' started here); "
        "default: start a local one",
    )
    group.add_argument(
        "--replica-num-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs per engine replica (fractions allowed; torch uses max(1, int(F)) threads)",
    )
    group.add_argument(
        "--router-imbalance-threshold",
        type=int,
        default=RouterConfig.imbalance_threshold,
        help="prefix router: tokens of load difference past which the least loaded replica wins",
    )


def wants_scale_out(args: argparse.Namespace) -> bool:
    return args.replicas > 1 or args.ray_address is not None


def run_scale_out(args: argparse.Namespace, server_config: Any) -> int:
    """Serve ``args`` on Ray Serve until SIGTERM/SIGINT; 0 after a clean drain, 1 if it could
    not start. ``server_config`` is the ``ServerConfig`` built from the same arguments."""
    from prefixserve.core.errors import InvalidArgumentError
    from prefixserve.entrypoints.engine_args import engine_kwargs
    from prefixserve.scale_out.router import RouterConfig

    try:
        from prefixserve.scale_out.deployments import ScaleOutConfig
    except ImportError as exc:
        raise SystemExit(
            f"prefixserve: --replicas > 1 and --ray-address need Ray Serve ({exc}); "
            "install it with: pip install 'prefixserve[ray]'"
        ) from exc

    try:
        scale = ScaleOutConfig(
            replicas=args.replicas,
            router=args.router,
            ray_address=args.ray_address,
            replica_num_cpus=args.replica_num_cpus,
            router_config=RouterConfig(imbalance_threshold=args.router_imbalance_threshold),
        )
    except InvalidArgumentError as exc:
        raise SystemExit(f"prefixserve: {exc}") from exc
    return serve_cluster(
        engine_kwargs(args), server_config, scale, args.host, args.port, args.log_level
    )


def serve_cluster(
    engine_kwargs: dict[str, Any],
    server_config: Any,
    scale: Any,
    host: str,
    port: int,
    log_level: str = "info",
) -> int:
    import ray
    from ray import serve

    from prefixserve.scale_out.deployments import build_application

    local = scale.ray_address is None
    if local:
        num_cpus = max(os.cpu_count() or 1, math.ceil(scale.replicas * scale.replica_num_cpus))
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    else:
        ray.init(address=scale.ray_address)
    stop = _stop_on_signals()
    serve_level = "DEBUG" if log_level == "debug" else "WARNING"
    logging.getLogger("ray.serve").setLevel(serve_level)
    serve_logging = {"log_level": serve_level}
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config=serve_logging)
        try:
            app = build_application(engine_kwargs, server_config, scale)
            serve.run(app, name=scale.app_name, route_prefix="/", logging_config=serve_logging)
        except Exception as exc:
            logger.error("the application did not start: %s", exc)
            return 1
        logger.info(
            "serving on http://%s:%d: %d replicas, router %s, Ray %s",
            host, port, scale.replicas, scale.router, "local" if local else scale.ray_address,
        )  # fmt: skip
        stop.wait()
        _drain(scale.app_name, server_config.shutdown_grace_seconds)
        return 0
    finally:
        _shut_down(scale.app_name, local)


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM or SIGINT (installed after ``ray.init``, which sets
    its own); a second SIGINT exits at once."""
    stop = threading.Event()

    def handler(sig: int, _frame: Any) -> None:
        if stop.is_set() and sig == signal.SIGINT:
            raise KeyboardInterrupt
        logger.info("%s: draining", signal.Signals(sig).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _drain(app_name: str, grace_seconds: float) -> None:
    from ray import serve

    try:
        ingress = serve.get_app_handle(app_name)
        ingress.drain.remote(grace_seconds).result(timeout_s=grace_seconds + _DRAIN_MARGIN_S)
    except Exception as exc:
        logger.warning("drain did not complete: %s", exc)


def _shut_down(app_name: str, local: bool) -> None:
    import ray
    from ray import serve

    try:
        if not local:
            serve.delete(app_name)
        if local or not serve.status().applications:
            serve.shutdown()
    except Exception as exc:
        logger.warning("Serve did not shut down cleanly: %s", exc)
    ray.shutdown()
