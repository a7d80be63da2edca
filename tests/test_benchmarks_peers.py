"""The llama.cpp peer helpers (benchmarks/peers): command lines, SSE parsing, the GGUF cache and the
roofline, without the built binary; one real prefixserve server checks the streamed request, and
the tests that need ``llama-server`` skip when it is not built."""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path

import pytest

from tests.servers import server_process

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from decode import http as decode  # noqa: E402
from peers import llama_server as peer  # noqa: E402
from peers import roofline  # noqa: E402


def test_llama_server_command_binds_loopback_and_sizes_context_over_slots() -> None:
    cmd = peer.llama_server_command(
        "/b/llama-server", "/m/x.gguf", 4321, threads=2, parallel=8, ctx_per_slot=512,
        extra=["--spec-type", "ngram-simple"],
    )  # fmt: skip
    assert cmd[0] == "/b/llama-server"

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (value("-m"), value("--host"), value("--port")) == ("/m/x.gguf", "127.0.0.1", "4321")
    assert (value("-t"), value("-tb"), value("-np"), value("-c")) == ("2", "2", "8", "4096")
    assert cmd[-2:] == ["--spec-type", "ngram-simple"]


def test_prefixserve_command_runs_this_python_on_loopback() -> None:
    cmd = peer.prefixserve_command("/m/x.gguf", 999, max_num_seqs=32, extra=["--gguf-dequantize"])
    assert cmd[:5] == [sys.executable, "-m", "prefixserve", "serve", "/m/x.gguf"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "32"
    assert cmd[-1] == "--gguf-dequantize"
    assert peer.server_env(3)["OMP_NUM_THREADS"] == "3"


def test_completion_body_asks_both_servers_for_exactly_max_tokens() -> None:
    body = peer.completion_body([1, 2, 3], 16, model="m")
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "m"
    assert "model" not in peer.completion_body("hi", 4)


def test_parse_sse_line() -> None:
    assert peer.parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert peer.parse_sse_line('data:{"a": 2}') == {"a": 2}
    assert peer.parse_sse_line("data: [DONE]") is None
    assert peer.parse_sse_line(": keep-alive") is None
    assert peer.parse_sse_line("") is None


def test_absorb_reads_completions_chat_usage_and_llama_timings() -> None:
    result = peer.StreamResult(submit=0.0)
    chunks = [
        {"choices": [{"index": 0, "text": "Hel"}]},
        {"choices": [{"index": 0, "text": ""}]},  # a partial UTF-8 token: no text, no time
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]},
        {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5,
                                  "prompt_tokens_details": {"cached_tokens": 4}},
         "timings": {"draft_n": 6, "draft_n_accepted": 3}},
    ]  # fmt: skip
    for t, chunk in enumerate(chunks, start=1):
        peer.absorb(result, chunk, float(t))
    result.finish = 5.0
    assert result.text == "Hello"
    assert result.chunk_times == [1.0, 3.0, 4.0]
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (7, 5, 4)
    assert result.timings == {"draft_n": 6, "draft_n_accepted": 3}
    assert result.ttft == 1.0
    assert result.decode_rate == pytest.approx((5 - 1) / (5.0 - 1.0))
    assert len(result.chunks) == 5


def _fake_binary(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_binary_prefers_the_cache_dir_and_says_how_to_build(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peer.find_binary("llama-server") is None
    with pytest.raises(peer.PeerUnavailable, match=r"build_llama_server\.sh"):
        peer.require_binary("llama-server")
    built = _fake_binary(peer.bin_dir(), "llama-server", "exit 0\n")
    assert peer.find_binary("llama-server") == built
    assert peer.find_binary("llama-server", "portable") is None  # each build its own folder
    with pytest.raises(peer.PeerUnavailable, match=r"LLAMA_CPP_BUILD=portable"):
        peer.require_binary("llama-server", "portable")


def test_the_native_build_is_keyed_by_the_cpus_flags(tmp_path, monkeypatch) -> None:
    """Native: ``build-native-<digest of the flags>``, so a cache shared with a machine with
    other features never runs a binary built for this one; portable: one folder."""
    monkeypatch.setenv("PREFIXSERVE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    native, portable = peer.bin_dir("native"), peer.bin_dir("portable")
    assert portable == tmp_path / "cache" / "build-portable" / "bin"
    assert native.parent.parent == tmp_path / "cache"
    assert native.parent.name.startswith("build-native-") and len(native.parent.name) == 25
    with pytest.raises(ValueError, match=r"unknown llama\.cpp build"):
        peer.bin_dir("fast")


def test_gguf_of_type_runs_llama_quantize_once_and_caches(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    calls = tmp_path / "calls"
    # a stand-in llama-quantize: records its arguments, copies the input to the output
    _fake_binary(peer.bin_dir(), "llama-quantize",
                 f'echo "$@" >> {calls}\ncp "$2" "$3"\n')  # fmt: skip
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    assert peer.gguf_of_type(source, "Q4_1") == source
    with pytest.raises(ValueError, match="unknown GGUF type"):
        peer.gguf_of_type(source, "Q5_K")
    out = peer.gguf_of_type(source, "Q8_0")
    assert out == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert out.read_bytes() == b"GGUF"
    assert peer.gguf_of_type(source, "Q8_0") == out  # cached: not run again
    (line,) = calls.read_text().splitlines()
    assert line.split() == ["--allow-requantize", str(source), str(out.with_suffix(".tmp")), "Q8_0"]


def test_gguf_of_type_reports_a_failing_quantize(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    _fake_binary(peer.bin_dir(), "llama-quantize", "echo bad >&2\nexit 3\n")
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(RuntimeError, match="bad"):
        peer.gguf_of_type(source, "F32")
    assert not (tmp_path / "cache" / "models" / "m.F32.gguf").exists()


def test_running_reports_a_server_that_exits(tmp_path) -> None:
    script = _fake_binary(tmp_path, "dies", "echo no model here\nexit 2\n")
    with pytest.raises(RuntimeError, match="no model here"), peer.running([str(script)], 1):
        pass


def test_roofline() -> None:
    assert roofline.roofline_tokens_per_s(500, 1000.0) == 2.0
    assert roofline.roofline_tokens_per_s(500, 1000.0, streams=8) == 16.0
    with pytest.raises(ValueError):
        roofline.roofline_tokens_per_s(0, 1.0)
    assert roofline.copy_bandwidth(mib=4, repeats=2) > 1e8  # any machine copies 100 MB/s


def test_decode_phase_ms_and_prompts() -> None:
    before = {"num_steps": 10, "schedule": 0.1, "forward": 1.0}
    after = {"num_steps": 20, "schedule": 0.2, "forward": 1.5}
    assert decode.phase_ms(before, after) == pytest.approx({"schedule": 10.0, "forward": 50.0})
    assert decode.phase_ms(None, after) is None
    assert decode.phase_ms(after, after) is None
    assert decode.random_prompt("a", 8) == decode.random_prompt("a", 8)
    assert decode.random_prompt("a", 8) != decode.random_prompt("b", 8)


def test_stream_request_against_prefixserve() -> None:
    """The helper's body and parser on a real server: exactly max_tokens, usage read."""
    with server_process() as (_, base):

        async def go() -> peer.StreamResult:
            async with peer.session(base) as client:
                body = peer.completion_body([5, 6, 7, 8], 6, model="prefixserve/tiny-random")
                return await peer.stream_request(client, "/v1/completions", body)

        result = asyncio.run(go())
        assert result.completion_tokens == 6 and result.prompt_tokens == 4
        assert result.chunk_times and result.finish >= result.chunk_times[-1]
        assert decode.step_phases(base) is None or "forward" in decode.step_phases(base)


@pytest.mark.skipif(peer.find_binary("llama-server") is None, reason="llama-server not built")
def test_llama_server_streams_exactly_max_tokens() -> None:
    try:
        model = peer.smollm2_gguf()
    except peer.PeerUnavailable as exc:
        pytest.skip(str(exc))
    port = peer.free_port()
    cmd = peer.llama_server_command(peer.require_binary("llama-server"), model, port,
                                    threads=1, parallel=2, ctx_per_slot=256)  # fmt: skip
    with peer.running(cmd, port) as base:

        async def go() -> peer.StreamResult:
            async with peer.session(base) as client:
                body = peer.completion_body(decode.random_prompt("t", 8), 12)
                return await peer.stream_request(client, "/v1/completions", body)

        result = asyncio.run(go())
    assert result.completion_tokens == 12
    assert result.timings is not None and result.timings["predicted_n"] == 12


def test_speculative_peer_status_reads_the_builds_help(tmp_path, monkeypatch) -> None:
    import speculative

    monkeypatch.setenv("PREFIXSERVE_LLAMA_CPP_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    binary, status = speculative.peer_status()
    assert binary is None and "not built" in status
    bin_dir = peer.bin_dir()
    _fake_binary(bin_dir, "llama-server", "echo '--spec-type none,draft-simple'\n")
    binary, status = speculative.peer_status()
    assert binary == str(bin_dir / "llama-server") and "no n-gram speculation" in status
    _fake_binary(bin_dir, "llama-server", "echo '--spec-type none,ngram-simple,ngram-mod'\n")
    assert "ngram-simple" in speculative.peer_status()[1]
