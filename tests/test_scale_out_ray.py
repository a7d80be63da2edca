"""Scale-out on a real local Ray cluster: two engine replicas (half a CPU each, torch threads 1,
the built-in model) behind the ingress, over HTTP.

One Ray cluster serves the whole module; the application is redeployed when a test needs another
router. The first test runs the CLI itself (its own local Ray) and stops it with SIGTERM. If Ray
cannot start on this machine the tests are skipped with a message saying so.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest
from servers import MODEL, free_port

ray = pytest.importorskip("ray", reason="RAY IS NOT INSTALLED: pip install 'prefixserve[ray]'")
from ray import serve  # noqa: E402

from prefixserve.api.server import ServerConfig  # noqa: E402
from prefixserve.scale_out.deployments import ScaleOutConfig, build_application  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from workloads import WORDS  # noqa: E402

BS = 16
ENGINE = dict(model=None, num_kv_blocks=256, max_model_len=2048, max_num_seqs=64, block_size=BS)


def system_prompt(seed: int, words: int = 90) -> str:
    """A distinct long system prompt of the load generator's words (about 500 tokens of the
    built-in tokenizer)."""
    body = " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))
    return f"Conversation {seed}. You are agent number {seed}. {body}"


def chat(system: str, user: str, max_tokens: int = 4, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        **extra,
    }


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


# --- the CLI: start, serve, SIGTERM, nothing left ------------------------------------------------


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not running
        return f.read().split(") ")[-1][0] != "Z"


def test_the_cli_serves_replicas_and_sigterm_drains_and_stops_everything(tmp_path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "prefixserve", "serve", "--replicas", "2",
           "--replica-num-cpus", "0.5", "--port", str(port), "--num-kv-blocks", "128",
           "--max-model-len", "1024", "--shutdown-grace-seconds", "20", "--log-level", "warning"]  # fmt: skip
    log = tmp_path / "serve.log"  # a file, not a pipe: Ray's output must never block it
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{base}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(healthy, 120, "the cluster to serve")
        r = httpx.post(f"{base}/v1/chat/completions", json=chat("hi", "there"), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        started = _descendants(proc.pid)
        with httpx.Client(timeout=60) as client:
            body = chat("a long answer", "go", max_tokens=200, ignore_eos=True, stream=True)
            with client.stream("POST", f"{base}/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                proc.send_signal(signal.SIGTERM)  # the drain lets this request finish
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        assert proc.wait(timeout=90) == 0, log.read_text()
        time.sleep(1.0)
        left = sorted(p for p in started if _alive(p))
        assert not left, f"still running after SIGTERM: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- one local cluster for the rest ------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A local Ray (2 CPUs) with Serve's HTTP proxy on a free port; yields the base URL."""
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    except Exception as exc:  # pragma: no cover - depends on the machine
        message = f"RAY CANNOT START ON THIS MACHINE ({exc!r}): the scale-out tests did not run"
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    port = free_port()
    serve.start(
        http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"}
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(base: str, router: str) -> httpx.Client:
    """(Re)deploy the application with ``router``; returns a client once both replicas report."""
    scale = ScaleOutConfig(replicas=2, router=router, replica_num_cpus=0.5, stats_period_s=0.5)
    app = build_application(dict(ENGINE), ServerConfig(served_model_names=[]), scale)
    serve.run(app, name="prefixserve", route_prefix="/", logging_config={"log_level": "WARNING"})
    client = httpx.Client(base_url=base, timeout=120)
    until(lambda: replicas(client, router=router, count=2), 60, "two replica reports")
    return client


def replicas(client: httpx.Client, router: str | None = None, count: int = 2) -> list[dict]:
    stats = client.get("/stats").json()
    if router is not None and stats["router"] != router:
        return []
    return stats["replicas"] if len(stats["replicas"]) == count else []


def routed(client: httpx.Client) -> dict[str, int]:
    """Requests the router sent to each replica so far."""
    decisions = client.get("/stats").json()["decisions"]
    return {replica: sum(d["requests"].values()) for replica, d in decisions.items()}


@pytest.fixture(scope="module")
def prefix_client(cluster):
    client = deploy(cluster, "prefix")
    yield client
    client.close()


def cached_vs_optimum(client: httpx.Client, seeds: range) -> tuple[int, int]:
    """Eight conversations with distinct system prompts, each sent four times in turn (one
    request at a time). Returns (cached tokens reported, the most a perfect cache could give:
    the full blocks each request shares with an earlier one of its conversation)."""
    cached = optimum = 0
    sent: dict[int, list[list[int]]] = {seed: [] for seed in seeds}
    for turn in range(4):
        for seed in seeds:
            body = chat(system_prompt(seed), f"question {turn} for {seed}")
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            cached += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            ids = client.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
            best = max((_common(ids, earlier) for earlier in sent[seed]), default=0)
            optimum += min(best, len(ids) - 1) // BS * BS
            sent[seed].append(ids)
    return cached, optimum


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- prefix router ---------------------------------------------------------------------------------


def test_the_ingress_serves_the_same_api(prefix_client: httpx.Client) -> None:
    client = prefix_client
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [99999], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/chat/completions", json={**chat("a", "b"), "model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    body = {"model": MODEL, "prompt": "hello " * 30, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = [ln[6:] for ln in client.post("/v1/completions", json=body).text.splitlines()
              if ln.startswith("data: ")]  # fmt: skip
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 3
    metrics = client.get("/metrics").text
    assert (
        'prefixserve_prefix_cache_queries_total{model_name="prefixserve/tiny-random",replica="'
        in metrics
    )
    assert "prefixserve_router_requests_total{" in metrics
    assert "prefixserve_router_predicted_hit_tokens_total{" in metrics
    assert client.get("/dashboard").status_code == 200


def test_a_responses_chain_continues_on_the_replica_that_holds_it(prefix_client) -> None:
    """The ingress owns the Responses store; each continuation's prompt is the previous
    response's own ids plus the new item, so the router sends it where those blocks are, and
    every full block of the previous prompt and output is a hit."""
    before = routed(prefix_client)
    tools = [{"type": "function", "name": "step", "parameters": {"type": "object", "properties":
              {"n": {"type": "integer", "enum": [1, 2]}}, "required": ["n"]}}]  # fmt: skip
    body = {"model": MODEL, "instructions": system_prompt(2000), "tools": tools,
            "tool_choice": "required", "temperature": 0}  # fmt: skip
    r = prefix_client.post("/v1/responses", json={**body, "input": "go"})
    assert r.status_code == 200, r.text
    for turn in range(3):
        prev = r.json()
        output = {"type": "function_call_output", "call_id": prev["output"][0]["call_id"],
                  "output": f"done {turn}"}  # fmt: skip
        r = prefix_client.post("/v1/responses", json={
            **body, "input": [output], "previous_response_id": prev["id"]})  # fmt: skip
        assert r.status_code == 200, r.text
        full = prev["usage"]["input_tokens"] + prev["usage"]["output_tokens"] - 1
        assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] >= full // BS * BS
    after = routed(prefix_client)
    moved = sorted(after.get(k, 0) - before.get(k, 0) for k in after)
    assert moved[-1] == 4 and sum(moved) == 4  # all four requests on one replica


def retained_blocks(client: httpx.Client) -> int:
    return sum(r["retained_blocks"] for r in replicas(client))


def test_retained_kv_is_named_and_released_on_the_replica_that_holds_it(prefix_client) -> None:
    """A reply that ends in a tool call keeps its KV under the name the ingress gives it
    afterwards (a ``SessionCall`` to each replica), and the turn with the call's result ends the
    pause by that name; ``prompt_cache_retention`` keeps a prompt, and releasing it by the
    completion's id reaches the replica that holds it."""
    time.sleep(1.5)  # earlier tests' tool-call pauses, retained a moment after their replies,
    before = retained_blocks(prefix_client)  # reported (every 0.5 s): they stay retained
    tools = [{"type": "function", "function": {"name": "step", "parameters": {"type": "object",
              "properties": {"n": {"type": "integer", "enum": [1, 2]}}, "required": ["n"]}}}]  # fmt: skip
    call = prefix_client.post("/v1/chat/completions", json=chat(
        system_prompt(3000), "go", max_tokens=60, tools=tools, tool_choice="required",
        parallel_tool_calls=False))  # fmt: skip
    assert call.status_code == 200, call.text
    assert call.json()["choices"][0]["finish_reason"] == "tool_calls"
    until(lambda: retained_blocks(prefix_client) > before, 30, "the tool-call pause's KV")
    # the result resumes the pause by the name the ingress gave it: its retention is released
    message = call.json()["choices"][0]["message"]
    history = [*chat(system_prompt(3000), "go")["messages"], message,
               {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}]  # fmt: skip
    result = prefix_client.post("/v1/chat/completions", json={
        **chat("", "", max_tokens=2), "messages": history, "tools": tools, "tool_choice": "none"})  # fmt: skip
    assert result.status_code == 200, result.text
    until(lambda: retained_blocks(prefix_client) == before, 30, "the resumed pause's release")

    body = chat(system_prompt(3001), "keep this", prompt_cache_retention="24h")
    kept = prefix_client.post("/v1/chat/completions", json=body)
    assert kept.status_code == 200, kept.text
    until(lambda: retained_blocks(prefix_client) > before, 30, "the prompt's retention")
    released = prefix_client.post("/v1/kv/release", json={"id": kept.json()["id"]})
    assert released.status_code == 200, released.text
    assert released.json()["released_blocks"] > 0
    until(lambda: retained_blocks(prefix_client) == before, 30, "the release")


def test_a_burst_of_one_new_prefix_lands_on_one_replica(prefix_client: httpx.Client) -> None:
    before = routed(prefix_client)
    system = system_prompt(1000)

    async def burst() -> list[int]:
        async with httpx.AsyncClient(base_url=str(prefix_client.base_url), timeout=120) as c:
            bodies = [chat(system, f"burst {i}") for i in range(8)]
            responses = await asyncio.gather(*(c.post("/v1/chat/completions", json=b)
                                               for b in bodies))  # fmt: skip
            return [r.status_code for r in responses]

    assert asyncio.run(burst()) == [200] * 8
    after = routed(prefix_client)
    gained = sorted(after.get(k, 0) - before.get(k, 0) for k in after)
    assert gained[-1] == 8 and sum(gained) == 8, gained


def test_48_concurrent_streams_over_four_prefixes_all_complete(prefix_client) -> None:
    systems = [system_prompt(2000 + g) for g in range(4)]

    async def one(c: httpx.AsyncClient, i: int) -> list[str]:
        body = chat(systems[i % 4], f"stream {i}", max_tokens=8, stream=True)
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            return [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]

    async def run() -> list[list[str]]:
        async with httpx.AsyncClient(base_url=str(prefix_client.base_url), timeout=180) as c:
            return await asyncio.gather(*(one(c, i) for i in range(48)))

    for events in asyncio.run(run()):
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
        assert '"finish_reason": "length"' in events[-2]


def test_prefix_routing_reaches_the_optimum(prefix_client: httpx.Client) -> None:
    cached, optimum = cached_vs_optimum(prefix_client, range(8))
    assert optimum > 0 and cached >= 0.95 * optimum, (cached, optimum)


def test_a_client_that_leaves_aborts_the_request_on_its_replica(prefix_client) -> None:
    def generated() -> int:
        return sum(r["generation_tokens"] for r in replicas(prefix_client))

    before = generated()
    body = chat("a very long answer", "please", max_tokens=1500, ignore_eos=True, stream=True)
    with prefix_client.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
    # the replica's engine stops the request: its token count stops growing, far from 1500
    # (replica stats lag up to one 0.5 s report)
    counts = [generated()]
    for _ in range(20):
        time.sleep(1.0)
        counts.append(generated())
        if counts[-1] == counts[-2] > before:
            break
    assert counts[-1] == counts[-2] and counts[-1] - before < 1500, counts
    assert all(rep["num_requests_running"] == 0 for rep in replicas(prefix_client))


def test_a_killed_replica_loses_no_request_and_comes_back(prefix_client) -> None:
    client = prefix_client
    victim = replicas(client)[0]
    systems = [system_prompt(3000 + g) for g in range(4)]
    progress: dict[int, int] = {}

    async def one(c: httpx.AsyncClient, i: int, max_tokens: int) -> list[str]:
        body = chat(systems[i % 4], f"kill {i}", max_tokens=max_tokens, ignore_eos=True,
                    stream=True)  # fmt: skip
        events = []
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return [f"status {r.status_code}"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    progress[i] = len(events)
        return events

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as c:
            streaming = [asyncio.create_task(one(c, i, 300)) for i in range(16)]
            while len(progress) < 16 or min(progress.values()) < 4:  # all are streaming
                await asyncio.sleep(0.05)
            os.kill(victim["pid"], signal.SIGKILL)
            after = await asyncio.gather(*(one(c, 100 + i, 4) for i in range(8)))
            return await asyncio.gather(*streaming), after

    streamed, sent_after = asyncio.run(asyncio.wait_for(run(), 150))
    failed = 0
    for events in streamed:  # each ends: finished, or an OpenAI error event then [DONE]
        assert events[-1] == "data: [DONE]", events[-3:]
        if '"error"' in events[-2]:
            error = json.loads(events[-2][6:])["error"]
            assert error["code"] == 503 and "retry" in error["message"]
            failed += 1
        else:
            assert '"finish_reason": "length"' in events[-2]
    assert 0 < failed < len(streamed)
    for events in sent_after:  # not started when the replica died: retried elsewhere
        assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2], events
    back = until(
        lambda: [r for r in replicas(client) if r["replica"] != victim["replica"]]
        if len(replicas(client)) == 2 and victim["replica"] not in
        {r["replica"] for r in replicas(client)} else None,
        90,
        "Ray to restart the replica",
    )  # fmt: skip
    assert len(back) == 2
    gone = client.get("/stats").json()["decisions"][victim["replica"]]
    assert not gone["live"] and gone["mirrored_blocks"] == 0 and gone["load_tokens"] == 0
    r = client.post("/v1/chat/completions", json=chat(systems[0], "after the restart"))
    assert r.status_code == 200


# --- baselines --------------------------------------------------------------------------------------


def test_pow2_gets_measurably_fewer_hits_and_ray_prefix_routes(cluster) -> None:
    client = deploy(cluster, "pow2")
    cached, optimum = cached_vs_optimum(client, range(100, 108))
    assert cached < 0.9 * optimum, (cached, optimum)
    decisions = client.get("/stats").json()["decisions"]
    assert sum(d["requests"].get("pow2", 0) for d in decisions.values()) == 32
    client = deploy(cluster, "ray-prefix")
    r = client.post("/v1/chat/completions", json=chat(system_prompt(5), "ray prefix"))
    assert r.status_code == 200
    decisions = client.get("/stats").json()["decisions"]
    assert sum(d["requests"].get("ray-prefix", 0) for d in decisions.values()) == 1
