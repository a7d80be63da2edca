"""Test helpers: a real ``prefixserve serve`` process on a free port, and its metrics."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

MODEL = "prefixserve/tiny-random"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(
    *extra: str, env: dict | None = None, num_kv_blocks: int = 512, timeout: float = 90.0
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``python -m prefixserve serve`` on a free port, once healthy: yields (process, base URL).
    Stored responses stay in memory unless ``extra`` names a ``--responses-store-path``.

    On exit the process is terminated (killed if it does not stop in 15 s).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--port", str(port)]
    cmd += ["--num-kv-blocks", str(num_kv_blocks), "--max-model-len", "1024"]
    cmd += ["--log-level", "warning", "--responses-store-path", ":memory:", *extra]
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, time.monotonic() + timeout)
        yield proc, base
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """Terminate ``proc``, kill it if it has not stopped within 15 s, and reap it."""
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    proc.kill()  # nothing once it has exited
    proc.wait()


def _wait_healthy(proc: subprocess.Popen, base: str, deadline: float) -> None:
    """Until ``base``/health answers 200; an error if the process exits or ``deadline`` passes."""
    while proc.poll() is None:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError("server did not become healthy")
        time.sleep(0.2)
    raise RuntimeError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")


@contextmanager
def launch_server(*extra: str, env: dict | None = None) -> Iterator[str]:
    """``server_process`` yielding only the base URL."""
    with server_process(*extra, env=env) as (_, base):
        yield base


def scrape(base: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for every sample."""
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    want = {"model_name": MODEL, **labels}
    for key, value in samples.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in want.items()):
            return value
    raise KeyError(name)
