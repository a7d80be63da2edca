"""The Codex CLI (npm ``@openai/codex``, pinned), unchanged, against a live ``prefixserve serve``
over the Responses API: a turn that answers, and a turn in which the model calls Codex's
``exec_command`` tool and gets the command's output back; and Codex with its default
configuration plus a provider (its web search, instructions and features as shipped), over HTTP
and WebSocket, and under a catalogued model name (``gpt-5.5``: Codex then sends
``reasoning.effort``, a ``custom`` apply_patch tool with a Lark grammar and ``tool_search``).

Codex's prompt is about 5,600 tokens of the built-in tokenizer with short instructions, about
26,000 with its own, past the built-in model's 4,096 positions, so the server runs a tiny random
checkpoint with 32,768.
"""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint
from codex_cli import (
    codex_binary,
    codex_home,
    run_codex,
    steering_proxy,
    steering_websocket_proxy,
)
from servers import metric, scrape, server_process

MODEL = "codex-test"
CATALOGUED = "gpt-5.5"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def codex():
    return codex_binary()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt"), max_position_embeddings=32768)
    with server_process(str(folder), "--max-model-len", "32768", "--served-model-name", MODEL,
                        CATALOGUED, "--tool-call-parser", "hermes", num_kv_blocks=6144,
                        timeout=180) as (_, base):  # fmt: skip
        yield base


def test_codex_exec_answers_over_http(codex, server, tmp_path):
    home = codex_home(tmp_path / "home", f"{server}/v1", MODEL)
    done = run_codex(codex, home, tmp_path / "work", "say hi")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tokens used" in done.stderr + done.stdout


def test_codex_runs_exec_command_and_reads_its_output(codex, server, tmp_path):
    with steering_proxy(server, "echo codex-ok") as (url, recorded):
        home = codex_home(tmp_path / "home", url, MODEL)
        done = run_codex(codex, home, tmp_path / "work", "run a command")
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = recorded[0], recorded[1]
    assert first["stream"] is True and first["store"] is False
    (call,) = [i for i in second["input"] if i.get("type") == "function_call"]
    assert call["name"] == "exec_command" and call["arguments"] == '{"cmd": "echo codex-ok"}'
    (result,) = [i for i in second["input"] if i.get("type") == "function_call_output"]
    assert "codex-ok" in str(result["output"])


def test_codex_over_websocket_continues_token_exact(codex, server, tmp_path):
    """Codex's WebSocket mode: a warm-up, then frames that continue the previous response with
    only their new items (store: false), the tool result included; each continuation is spliced
    from the connection's own chain."""
    before = metric(scrape(server), "prefixserve_responses_continuations_total",
                    model_name=MODEL, kind="token_exact")  # fmt: skip
    with steering_websocket_proxy(server, "echo codex-ok") as (url, frames):
        home = codex_home(tmp_path / "home", url, MODEL, websockets=True)
        done = run_codex(codex, home, tmp_path / "work", "run a command")
    assert done.returncode == 0, done.stderr[-2000:]
    warmup, *turns = frames
    assert warmup["generate"] is False and "previous_response_id" not in warmup
    assert len(turns) >= 2 and all(t.get("previous_response_id") for t in turns)
    assert all(t["store"] is False for t in frames)
    assert [i["type"] for i in turns[1]["input"]] == ["function_call_output"]
    assert "codex-ok" in str(turns[1]["input"][0]["output"])
    after = metric(scrape(server), "prefixserve_responses_continuations_total",
                   model_name=MODEL, kind="token_exact")  # fmt: skip
    assert after - before == len(turns)


def not_offered(base: str, kind: str) -> float:
    try:
        return metric(scrape(base), "prefixserve_responses_tools_not_offered_total",
                      model_name=MODEL, type=kind)  # fmt: skip
    except KeyError:
        return 0.0


@pytest.mark.parametrize("model", [MODEL, CATALOGUED])
def test_codex_with_its_default_configuration_over_http(codex, server, tmp_path, model):
    """Issue 30: Codex's first turn with only a provider configured was a 400 (its web_search
    tool; with a catalogued name also reasoning.effort, a custom tool and tool_search)."""
    before = not_offered(server, "web_search")
    with steering_proxy(server, None) as (url, recorded):
        home = codex_home(tmp_path / "home", url, model, default=True)
        done = run_codex(codex, home, tmp_path / "work", "say hi")
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = {tool["type"] for tool in recorded[0]["tools"]}
    assert "web_search" in kinds and not_offered(server, "web_search") > before
    if model == CATALOGUED:
        assert {"custom", "tool_search"} <= kinds and recorded[0]["reasoning"]["effort"]


def test_codex_with_its_default_configuration_over_websocket(codex, server, tmp_path):
    with steering_websocket_proxy(server, None) as (url, frames):
        home = codex_home(tmp_path / "home", url, CATALOGUED, websockets=True, default=True)
        done = run_codex(codex, home, tmp_path / "work", "say hi")
    assert done.returncode == 0, done.stderr[-2000:]
    assert any(tool["type"] == "web_search" for tool in frames[-1]["tools"])
