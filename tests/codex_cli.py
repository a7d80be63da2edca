"""Test helpers for the Codex CLI as a real client: its pinned npm install, an offline
``CODEX_HOME``, and a recording proxy that can steer the model into one tool call.

The install goes to ``.cache/codex-<version>`` in the repository (ignored by git) and is reused;
without ``npm``, or when the registry cannot be reached, the tests that need it are skipped with
the reason. Codex is kept offline (no plugins, apps, analytics, feedback, web search) and never
retries, and it is only ever pointed at 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

CODEX_VERSION = "0.171.0"
REPO = Path(__file__).resolve().parent.parent


def codex_binary() -> Path:
    """The pinned Codex CLI, installed once with npm (skips the test when that is impossible)."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not on PATH: the Codex CLI tests need Node.js and npm")
    prefix = REPO / ".cache" / f"codex-{CODEX_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
             f"@openai/codex@{CODEX_VERSION}"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if done.returncode != 0 or not binary.exists():
            pytest.skip(f"npm could not install @openai/codex@{CODEX_VERSION}: {done.stderr[-400:]}")
    return binary


def codex_home(
    folder: Path, base_url: str, model: str, websockets: bool = False, default: bool = False
) -> Path:
    """A ``CODEX_HOME`` whose only provider is ``base_url``, offline and without retries; short
    base instructions keep the prompt within a small test model's context. ``default``: Codex's
    own configuration otherwise (its instructions, web search, plugins and features as shipped);
    only analytics and feedback, which would leave the machine, stay off."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "instructions.md").write_text("You are a coding agent. Be brief.\n")
    provider = f"""\
[model_providers.local]
name = "local"
base_url = "{base_url}"
wire_api = "responses"
env_key = "PREFIXSERVE_TEST_KEY"
request_max_retries = 0
stream_max_retries = 0
supports_websockets = {"true" if websockets else "false"}

[analytics]
enabled = false

[feedback]
enabled = false
"""
    head = f'model = "{model}"\nmodel_provider = "local"\n'
    if not default:
        head += f"""\
model_instructions_file = "{folder / "instructions.md"}"
web_search = "disabled"

[features]
plugins = false
remote_plugin = false
apps = false
plugin_sharing = false
unbounded_connection_retries = false
goals = false

[agents]
enabled = false
"""
    (folder / "config.toml").write_text(f"{head}\n{provider}")
    return folder


def run_codex(binary: Path, home: Path, workdir: Path, prompt: str) -> subprocess.CompletedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [str(binary), "exec", "--skip-git-repo-check", "--ephemeral", "-s", "read-only", prompt],
        cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": str(home), "CODEX_HOME": str(home),
                          "PREFIXSERVE_TEST_KEY": "unused"},
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@contextmanager
def steering_proxy(upstream: str, command: str | None) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP proxy to ``upstream`` that records each POST body as Codex sent it and steers it
    (``_steer``). Yields (its /v1 URL, the recorded bodies)."""
    recorded: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            recorded.append(json.loads(json.dumps(body)))
            _steer(body, command)
            headers = {"authorization": self.headers.get("authorization", "")}
            with httpx.stream("POST", upstream + self.path, json=body, headers=headers,
                              timeout=300) as reply:  # fmt: skip
                self.send_response(reply.status_code)
                self.send_header("content-type", reply.headers.get("content-type", ""))
                self.end_headers()
                for chunk in reply.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", recorded
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def steering_websocket_proxy(upstream: str, command: str | None) -> Iterator[tuple[str, list[dict]]]:
    """``steering_proxy`` for Responses over WebSocket: relays frames both ways, recording and
    steering each ``response.create`` frame the same way (a warm-up is left alone)."""
    from websockets.asyncio.client import connect
    from websockets.asyncio.server import serve

    recorded: list[dict] = []
    target = upstream.replace("http://", "ws://", 1)

    async def relay(client) -> None:
        headers = {"authorization": client.request.headers.get("authorization", "")}
        async with connect(target + client.request.path, additional_headers=headers) as server:

            async def up() -> None:
                async for frame in client:
                    recorded.append(json.loads(frame))
                    body = json.loads(frame)
                    _steer(body, command)
                    await server.send(json.dumps(body))

            async def down() -> None:
                async for frame in server:
                    await client.send(frame)

            tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()

    async def start():
        return await serve(relay, "127.0.0.1", 0)

    loop = asyncio.new_event_loop()
    started = loop.run_until_complete(start())
    port = started.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1", recorded
    finally:

        async def close() -> None:
            started.close()
            await started.wait_closed()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _steer(body: dict, command: str | None) -> None:
    """With a ``command``: narrow ``exec_command``'s ``cmd`` to it in every request (so the
    tools, and the rendered prompt, stay the same all session), and force a call of it on a turn
    that has no tool result yet (not on a ``generate: false`` warm-up): a random-weight model
    would never choose it. Without one: the model calls nothing (``tool_choice: "none"``; the
    tools are still in the prompt), since a random model that starts a call under a strict
    tool's grammar (Codex's apply_patch) may not finish it within the context."""
    if command is None:
        body["tool_choice"] = "none"
        return
    for tool in body.get("tools") or []:
        if tool.get("name") == "exec_command":
            tool["parameters"] = {"type": "object", "required": ["cmd"],
                                  "additionalProperties": False,
                                  "properties": {"cmd": {"type": "string", "enum": [command]}}}
    items = body.get("input") or []
    if body.get("generate", True) and not any(
        item.get("type") == "function_call_output" for item in items
    ):
        body["tool_choice"] = {"type": "function", "name": "exec_command"}
